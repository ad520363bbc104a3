//go:build !sandboxtest

package sandbox

import "log/slog"

// testHook is the sandboxtest build's hook (testhook_sandboxtest.go); in
// the daemon it does nothing.
func testHook(*slog.Logger) {}
