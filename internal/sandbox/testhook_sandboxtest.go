//go:build sandboxtest

package sandbox

import (
	"log/slog"
	"os"

	"golang.org/x/sys/unix"
)

// TestHookEnv, in a binary built with -tags sandboxtest, makes the daemon
// call sysinfo(2) — never on the allowlist — right after the filter is
// loaded: the tests see it killed under --seccomp kill and logged under
// --seccomp log.
const TestHookEnv = "GOVIRTIOFSD_SANDBOXTEST_SYSINFO"

func testHook(log *slog.Logger) {
	if os.Getenv(TestHookEnv) == "" {
		return
	}
	var si unix.Sysinfo_t
	err := unix.Sysinfo(&si)
	log.Info("sandboxtest: sysinfo outside the allowlist returned", "err", err)
}
