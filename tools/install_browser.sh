#!/bin/sh
# Install Chromium and its WebDriver for tests/test_book_browser.py where this machine allows it:
# apt-get (Debian, Ubuntu) run as root, as in CI. Anywhere else, or when apt-get fails, it says so
# in one line (also the last line of LOG) and succeeds anyway: the browser test then skips and
# gives that line as its reason.  Usage: sh tools/install_browser.sh LOG   (`make setup` runs it)
log=${1:-/dev/null}
have_browser() {
  command -v chromedriver >/dev/null 2>&1 && {
    command -v chromium || command -v chromium-browser || command -v google-chrome; } >/dev/null 2>&1
}
say() { echo "$1"; echo "$1" >>"$log"; }
: >"$log"
if have_browser; then
  say "Chromium and chromedriver found on PATH"
elif ! command -v apt-get >/dev/null 2>&1; then
  say "browser test: no apt-get here to install chromium and chromium-driver; install them to run it"
elif [ "$(id -u)" != 0 ]; then
  say "browser test: not root, so chromium and chromium-driver are not installed; sudo apt-get install chromium chromium-driver to run it"
else
  echo "installing chromium and chromium-driver with apt-get for the browser test (log: $log)"
  if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >>"$log" 2>&1 && have_browser; then
    say "Chromium and chromedriver installed"
  else
    say "browser test: apt-get could not install chromium and chromium-driver (see $log); the test will skip"
  fi
fi
exit 0
