//go:build linux

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
)

// TestBootInitRoundTrip: the guest mounts the share and makes a first access
// (ls, cat). Proves the vhost-user set-up and one FUSE round trip (INIT on
// request queue 1) with each guest kernel.
func TestBootInitRoundTrip(t *testing.T) {
	requireE2E(t)
	forEachKernel(t, func(t *testing.T, k guestKernel) { scenarioRoundTrip(t, ourDaemon, k) })
}

// TestGuestRebootAndRemount: the guest reboots (reset without -no-reboot: the
// rings are stopped and restarted with new addresses), mounts and accesses
// again; then QEMU quits and the daemon must exit 0 on the disconnect.
func TestGuestRebootAndRemount(t *testing.T) {
	requireE2E(t)
	forEachKernel(t, func(t *testing.T, k guestKernel) { scenarioReboot(t, ourDaemon, k, vmConfig{}) })
}

// TestGuestPowerOff: guest `poweroff -f`; QEMU exits 0 and the daemon exits 0
// within 5 s.
func TestGuestPowerOff(t *testing.T) {
	requireE2E(t)
	forEachKernel(t, func(t *testing.T, k guestKernel) { scenarioPowerOff(t, ourDaemon, k) })
}

// TestReferenceDaemonBoot runs the same scenarios against the reference C
// daemon (/usr/lib/qemu/virtiofsd) to validate this harness; it asserts only
// guest-side facts and process exits (the C daemon has no slog lines).
// Gated by GOVIRTIOFSD_E2E_REFERENCE=1.
func TestReferenceDaemonBoot(t *testing.T) {
	if os.Getenv("GOVIRTIOFSD_E2E_REFERENCE") != "1" {
		t.Skip("set GOVIRTIOFSD_E2E_REFERENCE=1 to run the scenarios against " + launch.ReferenceBin)
	}
	requireRoot(t)
	if _, err := os.Stat(launch.ReferenceBin); err != nil {
		t.Skipf("reference daemon: %v", err)
	}
	t.Run("roundtrip", func(t *testing.T) {
		forEachKernel(t, func(t *testing.T, k guestKernel) { scenarioRoundTrip(t, refDaemon, k) })
	})
	t.Run("reboot", func(t *testing.T) {
		forEachKernel(t, func(t *testing.T, k guestKernel) { scenarioReboot(t, refDaemon, k, vmConfig{}) })
	})
	t.Run("poweroff", func(t *testing.T) {
		forEachKernel(t, func(t *testing.T, k guestKernel) { scenarioPowerOff(t, refDaemon, k) })
	})
}

// ---------------------------------------------------------------------------

// env is one daemon serving a fresh share containing "hello".
type env struct {
	t      *testing.T
	kind   daemonKind
	kernel guestKernel
	dir    string // artifacts
	shared string
	sock   string
	extra  []string // the daemon's extra arguments
	d      *daemon
}

// newEnv starts a daemon of the given kind; extra arguments go to its command line.
func newEnv(t *testing.T, kind daemonKind, k guestKernel, extra ...string) *env {
	t.Helper()
	return newEnvAt(t, kind, k, t.TempDir(), extra...)
}

// newEnvAt is newEnv serving the directory shared (made by the caller).
func newEnvAt(t *testing.T, kind daemonKind, k guestKernel, shared string, extra ...string) *env {
	t.Helper()
	e := &env{t: t, kind: kind, kernel: k, dir: artifactDir(t), shared: shared, extra: extra}
	if err := os.WriteFile(filepath.Join(e.shared, "hello"), []byte(helloContent), 0o644); err != nil {
		t.Fatal(err)
	}
	// Short path: unix socket paths are limited to 108 bytes.
	sockDir, err := os.MkdirTemp("", "e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	e.sock = filepath.Join(sockDir, "vhost.sock")
	e.d = startDaemon(t, kind, e.sock, e.shared, filepath.Join(e.dir, "daemon.log"), extra...)
	return e
}

func (e *env) boot(script string, allowReboot bool) *vm {
	return e.start(vmConfig{Script: script, AllowReboot: allowReboot})
}

// start boots a guest on e's kernel and daemon. It returns once the
// guest's init has run (or QEMU ended, or its timeout passed). A guest
// that died booting (diedBooting) is booted once more, with a fresh
// daemon: ours exits when the front end goes.
func (e *env) start(cfg vmConfig) *vm {
	t := e.t
	t.Helper()
	cfg.Kernel, cfg.Sock = e.kernel, e.sock
	v := startVM(t, e.dir, cfg)
	if !v.diedBooting(v.timeout) {
		return v
	}
	discardBoot(t, e.dir, v, e.d)
	e.d = startDaemon(t, e.kind, e.sock, e.shared, filepath.Join(e.dir, "daemon.log"), e.extra...)
	v = startVM(t, e.dir, cfg)
	v.diedBooting(v.timeout) // a second crash is for the test to fail on
	return v
}

// summarize logs boot times and the interesting daemon lines.
func (e *env) summarize(v *vm, g guestRun) {
	t := e.t
	t.Logf("%s, %s: %d boot(s); since QEMU start: E2E-BOOT at %v, mounted at %v; guest uptime at mount %v; QEMU ran %.1fs",
		e.kind, e.kernel.Version, g.Boots, v.markerTimes(reBoot), v.markerTimes(reMounted), g.Uptimes,
		v.ExitTime().Sub(v.started).Seconds())
	for _, s := range g.Steps {
		t.Logf("  boot %d step %-8s rc=%d %s", s.Boot, s.Name, s.RC, strings.Join(s.Output, " | "))
	}
	if e.kind == ourDaemon {
		for _, l := range e.d.lifecycleLines(t) {
			t.Logf("  daemon: %s", l)
		}
		reqs := e.d.fuseRequests(t)
		for i, r := range reqs {
			if i == 20 {
				t.Logf("  ... %d more FUSE requests in %s", len(reqs)-i, e.d.LogPath)
				break
			}
			t.Logf("  daemon: queue=%s unique=%s opcode=%s nodeid=%s len=%s error=%d", r.Queue, r.Unique, r.Opcode, r.NodeID, r.Len, r.Error)
		}
	}
}

// daemonExit waits for the daemon to exit after QEMU did. With require it
// must exit 0 within daemonExitTimeout; otherwise it is only logged (and
// killed by the cleanup).
func (e *env) daemonExit(v *vm, require bool) {
	t := e.t
	t.Helper()
	if !e.d.Wait(daemonExitTimeout) {
		if require {
			t.Fatalf("%s still running %v after QEMU exited\n%s", e.kind, daemonExitTimeout, tail(e.d.LogPath, 20))
		}
		t.Logf("%s still running %v after QEMU exited", e.kind, daemonExitTimeout)
		return
	}
	// QEMU is reaped after it has closed the socket: the daemon often "exits first".
	after := max(e.d.ExitTime().Sub(v.ExitTime()), 0)
	t.Logf("%s exited with status %d, %.2fs after QEMU", e.kind, e.d.Status().Code, after.Seconds())
	if require && e.d.Status().Code != 0 {
		t.Fatalf("%s exit status %d (%v), want 0\n%s", e.kind, e.d.Status().Code, e.d.Err(), tail(e.d.LogPath, 20))
	}
}

// checkBoot checks one boot: the mount succeeded and the first access
// matches what the daemon answered to that boot's FUSE_INIT.
func (e *env) checkBoot(g guestRun, boot int, inits []fuseRequest) {
	t := e.t
	t.Helper()
	if m := g.step(t, boot, "mount"); m.RC != 0 {
		t.Fatalf("boot %d: mount -t virtiofs failed (rc=%d): %v", boot, m.RC, m.Output)
	}
	// The reference daemon always completes INIT; ours says in its log.
	initOK := true
	if e.kind == ourDaemon {
		if len(inits) < boot {
			t.Fatalf("boot %d: daemon log has %d INIT request(s)", boot, len(inits))
		}
		in := inits[boot-1]
		if in.Queue != "1" {
			t.Errorf("boot %d: INIT arrived on queue %s, want 1", boot, in.Queue)
		}
		initOK = in.Error == 0
	}
	cat := g.step(t, boot, "cat")
	got := strings.Join(cat.Output, "\n")
	if initOK {
		if cat.RC != 0 || got != strings.TrimSuffix(helloContent, "\n") {
			t.Errorf("boot %d: INIT succeeded but cat /mnt/hello: rc=%d output %q, want %q", boot, cat.RC, got, helloContent)
		}
	} else {
		if cat.RC == 0 {
			t.Errorf("boot %d: INIT failed but cat /mnt/hello succeeded: %q", boot, got)
		} else {
			t.Logf("boot %d: first access failed as expected (INIT error=%d): %s", boot, inits[boot-1].Error, got)
		}
	}
}

func (e *env) inits() []fuseRequest {
	if e.kind != ourDaemon {
		return nil
	}
	return filterOpcode(e.d.fuseRequests(e.t), "INIT")
}

func scenarioRoundTrip(t *testing.T, kind daemonKind, k guestKernel) {
	e := newEnv(t, kind, k)
	v := e.boot("access", false)
	v.waitExit()
	e.daemonExit(v, false)
	g := parseConsole(v.consoleLines())
	e.summarize(v, g)
	if g.Boots != 1 {
		t.Fatalf("guest booted %d times, want 1", g.Boots)
	}
	inits := e.inits()
	if kind == ourDaemon && len(inits) == 0 {
		t.Fatalf("no INIT request in the daemon log %s", e.d.LogPath)
	}
	e.checkBoot(g, 1, inits)
}

// scenarioReboot: base sets the QEMU and the ring layout (the zero value:
// QEMU 7.2, split rings; TestPackedRing asks for packed rings, which both
// boots must then have negotiated).
func scenarioReboot(t *testing.T, kind daemonKind, k guestKernel, base vmConfig) {
	e := newEnv(t, kind, k)
	base.Script, base.AllowReboot = "reboot", true
	v := e.start(base)
	to := vmTimeout()
	v.waitConsole(reAsk, 1, to)
	v.answer("reboot")
	v.waitConsole(reBoot, 2, to)
	v.waitConsole(reAsk, 2, to)
	v.quit() // the guest waits in e2e_ask; end QEMU from the monitor
	v.waitExit()
	e.daemonExit(v, true)
	g := parseConsole(v.consoleLines())
	e.summarize(v, g)
	if g.Boots != 2 {
		t.Fatalf("guest booted %d times, want 2", g.Boots)
	}
	if base.Packed {
		requirePacked(t, v.consoleLines(), 2)
	}
	inits := e.inits()
	if kind == ourDaemon && len(inits) != 2 {
		t.Fatalf("daemon log has %d INIT requests, want 2 (one per boot)", len(inits))
	}
	e.checkBoot(g, 1, inits)
	e.checkBoot(g, 2, inits)
}

func scenarioPowerOff(t *testing.T, kind daemonKind, k guestKernel) {
	e := newEnv(t, kind, k)
	v := e.boot("poweroff", false)
	v.waitExit() // requires exit status 0
	e.daemonExit(v, true)
	g := parseConsole(v.consoleLines())
	e.summarize(v, g)
	if m := g.step(t, 1, "mount"); m.RC != 0 {
		t.Errorf("mount failed (rc=%d): %v", m.RC, m.Output)
	}
	if len(g.Done) != 1 || g.Done[0] != "poweroff" {
		t.Errorf("guest E2E-DONE actions %v, want [poweroff]", g.Done)
	}
}
