#!/bin/sh
# Headless Chromium for the dashboard's browser test (test/server/test_dashboard_browser.py).
# Installs Debian's `chromium` where apt-get is available and we are root; anywhere else it says
# why not and exits 0: setup goes on, and the test is skipped with the same reason.
# Usage: scripts/install_browser.sh [STAMP]   (STAMP is touched once a browser is present)
stamp="$1"
found() {
    command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
        || { [ -n "$CHROMIUM" ] && [ -x "$CHROMIUM" ]; }
}
done_ok() {
    [ -n "$stamp" ] && touch "$stamp"
    exit 0
}
if found; then
    done_ok
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser: skipped (no apt-get here); install Chromium or set \$CHROMIUM for the dashboard's browser test"
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "browser: skipped (not root); 'sudo apt-get install chromium' enables the dashboard's browser test"
    exit 0
fi
echo "browser: installing Debian's chromium (the dashboard's browser test)"
if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; then
    found && done_ok
fi
echo "browser: skipped (apt-get could not install chromium); the dashboard's browser test will be skipped"
exit 0
