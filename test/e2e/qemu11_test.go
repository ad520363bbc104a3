//go:build linux

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestQEMU11 runs the stack of late 2026 (DESIGN.md §12): Linux 7.x from
// Debian sid (guest.sh series 7) under QEMU 11.x from sid (make test-deps:
// .cache/peers/bin/qemu-system-x86_64-11). Subtests:
//
//   - boot: TestQEMU10Boot's scenario (runBootPhases: boot, fio, reboot,
//     fio, power-off, the vhost-user messages per phase in
//     vhost-user-PHASE.txt), and QEMU 11 must send nothing our daemon does
//     not know: no "vhost-user message refused", no unnamed request and no
//     "unknown or unsupported" anywhere in its log. The kinds and counts
//     per phase land in vhost-user-summary.txt and the test log, with the
//     FUSE protocol the guest negotiated (the daemon's "FUSE session
//     started" lines; the minor is logged, not asserted).
//   - posix: posix.sh side by side, ours against the Rust virtiofsd 1.14
//     (both --cache never --xattr), the same results required but for
//     intendedDifferencesRust.
//   - migrate-rust114-ours: TestMigration's basic scenario, the Rust
//     virtiofsd 1.14 → ours, with the guest's open files.
func TestQEMU11(t *testing.T) {
	requireE2E(t)
	peersBin(t, qemu11Wrapper)
	k := newestKernel7(t)
	start := time.Now()
	timed := func(name string, fn func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			st := time.Now()
			defer func() { t.Logf("%s took %.1fs", name, time.Since(st).Seconds()) }()
			fn(t)
		})
	}
	timed("boot", func(t *testing.T) {
		e, phases := runBootPhases(t, qemu11, k)
		checkKnownMessages(t, e.d)
		summarizePhases(t, e.dir, phases)
		for _, l := range fuseSessionLines(t, e.d) {
			t.Logf("FUSE: %s", l)
		}
	})
	timed("posix", func(t *testing.T) {
		peersBin(t, rust114Name)
		posixSideBySideWith(t, rust114Daemon, k, vmConfig{QEMU: qemu11}, posixShare{parallel: true})
	})
	timed("migrate-rust114-ours", func(t *testing.T) {
		peersBin(t, rust114Name)
		m := newMigEnv(t, migPair{"rust114-ours", rust114Daemon, ourDaemon}, k)
		m.cfg.QEMU = qemu11
		scenarioMigrateBasic(m)
		summarizeMigration(t, m)
	})
	t.Logf("TestQEMU11 took %.1fs", time.Since(start).Seconds())
}

// checkKnownMessages fails the test if our daemon's log shows a vhost-user
// message it did not know or refused.
func checkKnownMessages(t *testing.T, d *daemon) {
	t.Helper()
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		kv := parseLogfmt(line)
		bad := ""
		switch {
		case kv["msg"] == "vhost-user message refused":
			bad = "refused"
		case kv["msg"] == "vhost-user message" && strings.HasPrefix(kv["request"], "request("):
			bad = "unnamed request"
		case strings.Contains(line, "unknown or unsupported"):
			bad = "unknown or unsupported"
		}
		if kv["msg"] == "vhost-user message" {
			n++
		}
		if bad != "" {
			t.Errorf("daemon log (%s): %s", bad, line)
		}
	}
	if n == 0 {
		t.Errorf("%s: no vhost-user message logged", d.LogPath)
	}
}

// summarizePhases logs the message kinds and their counts per phase and
// writes them to dir/vhost-user-summary.txt.
func summarizePhases(t *testing.T, dir string, phases []bootPhase) {
	t.Helper()
	var b strings.Builder
	for _, ph := range phases {
		counts := map[string]int{}
		for _, m := range ph.msgs {
			counts[m.Request]++
		}
		names := make([]string, 0, len(counts))
		for n := range counts {
			names = append(names, n)
		}
		slices.Sort(names)
		parts := make([]string, len(names))
		for i, n := range names {
			parts[i] = fmt.Sprintf("%s×%d", n, counts[n])
		}
		line := fmt.Sprintf("%s (%d messages, %d kinds): %s", ph.name, len(ph.msgs), len(names), strings.Join(parts, " "))
		t.Logf("vhost-user summary %s", line)
		b.WriteString(line + "\n")
	}
	if err := os.WriteFile(filepath.Join(dir, "vhost-user-summary.txt"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// fuseSessionLines returns our daemon's "FUSE session started" lines (the
// protocol the guest offered and the one negotiated).
func fuseSessionLines(t *testing.T, d *daemon) []string {
	t.Helper()
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		if parseLogfmt(line)["msg"] == "FUSE session started" {
			out = append(out, line)
		}
	}
	if len(out) == 0 {
		t.Errorf("%s: no \"FUSE session started\" line", d.LogPath)
	}
	return out
}

// summarizeMigration checks and summarizes (vhost-user-summary.txt) the
// messages each of our daemons in a migration scenario was sent, per hop:
// the source's from its start through the migration and quit, the
// destination's from its start (incoming, the load, the guest's run and
// power-off).
func summarizeMigration(t *testing.T, m *migEnv) {
	t.Helper()
	var phases []bootPhase
	for _, h := range m.hops {
		if h.kind != ourDaemon {
			continue
		}
		checkKnownMessages(t, h.d)
		phases = append(phases, bootPhase{name: "migration-" + h.name, msgs: h.d.vhostMessages(t, 0, -1)})
	}
	if len(phases) > 0 {
		summarizePhases(t, m.dir, phases)
	}
}
