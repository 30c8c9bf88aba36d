"""pytest plugin: write each failing test's id and the end of its report to $LIVE_FAILURES the moment
it fails (works under pytest-xdist: the controller receives the reports), so a run cut short by a
time limit still says what failed and why.  Use: ``pytest -p tools.pytest_live_failures ...``."""
import os


def pytest_runtest_logreport(report):
    if report.failed:
        path = os.environ.get("LIVE_FAILURES", "live-failures.txt")
        text = getattr(report, "longreprtext", "") or ""
        tail = "\n".join(text.splitlines()[-12:])
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{tail}\n")
