//go:build linux

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// newestKernelAtLeast returns the newest prepared guest kernel of at least
// major.minor, or skips the test.
func newestKernelAtLeast(t *testing.T, major, minor int, why string) guestKernel {
	t.Helper()
	var k guestKernel
	for _, gk := range guestKernels(t) {
		if kernelAtLeast(gk.Version, major, minor) {
			k = gk
		}
	}
	if k.Version == "" {
		t.Skipf("no guest kernel >= %d.%d prepared (%s; see GOVIRTIOFSD_E2E_KERNELS)", major, minor, why)
	}
	return k
}

// TestQEMU10Boot boots Linux 6.12 under QEMU 10 (make test-deps) against our
// daemon in its default sandbox (namespace, seccomp kill; --log-level
// debug): the guest mounts, reads the share and runs an 8 MiB fio write +
// crc32c verify (fio-reboot.sh); then it reboots (the host answers its
// E2E-ASK), does the same again, and powers off. QEMU must exit 0, the
// daemon 0 after it, and each boot must have one INIT, a good first access
// and a passing fio.
//
// It also records every vhost-user message QEMU 10 sent, per phase: boot
// (until the first E2E-ASK: the guest is then idle), reboot (until the
// second E2E-ASK) and poweroff (the rest, until the daemon exited), from
// the daemon's `msg="vhost-user message" request=NAME` lines. The ordered
// lists land in vhost-user-PHASE.txt in the test's log directory and a
// compact form in the test log: they are for checking QEMU 10's sequences
// against the daemon's expectations (DESIGN.md §2, §10), not asserted here.
func TestQEMU10Boot(t *testing.T) {
	requireE2E(t)
	peersBin(t, qemu10Wrapper)
	start := time.Now()
	k := newestKernelAtLeast(t, 6, 12, "QEMU 10 runs Linux 6.12 guests only")
	runBootPhases(t, qemu10, k)
	t.Logf("QEMU 10 boot test took %.1fs", time.Since(start).Seconds())
}

// bootPhase is the vhost-user messages the daemon logged in one phase of
// runBootPhases.
type bootPhase struct {
	name string
	msgs []vhostMessage
}

// runBootPhases is TestQEMU10Boot's scenario on QEMU q and kernel k: boot,
// fio, reboot, fio, power-off against our daemon at --log-level debug, the
// messages of each phase written to vhost-user-PHASE.txt and logged
// compactly; it fails on a refused message, a phase without messages (but
// power-off), a boot without its INIT, first access and fio, and returns
// the env and the phases for more checks.
func runBootPhases(t *testing.T, q qemuVersion, k guestKernel) (*env, []bootPhase) {
	t.Helper()
	e := newEnv(t, ourDaemon, k)
	v := e.start(vmConfig{QEMU: q, Script: "fio-reboot", AllowReboot: true, Append: []string{"e2e.fiosize=8M"}})
	to := vmTimeout()

	// The guest is idle while it waits in e2e_ask: the phases end there.
	var cuts []int64
	settle := func() int64 {
		time.Sleep(300 * time.Millisecond)
		return e.d.logSize(t)
	}
	v.waitConsole(reAsk, 1, to)
	cuts = append(cuts, settle())
	v.answer("reboot")
	v.waitConsole(reBoot, 2, to)
	v.waitConsole(reAsk, 2, to)
	cuts = append(cuts, settle())
	v.answer("poweroff")
	v.waitExit()
	e.daemonExit(v, true)
	g := parseConsole(v.consoleLines())
	t.Logf("%s under %s: %d boot(s); since QEMU start: E2E-BOOT at %v, mounted at %v; QEMU ran %.1fs",
		k.Version, q, g.Boots, v.markerTimes(reBoot), v.markerTimes(reMounted), v.ExitTime().Sub(v.started).Seconds())
	for _, s := range g.Steps {
		t.Logf("  boot %d step %-8s rc=%d", s.Boot, s.Name, s.RC)
	}
	for _, l := range e.d.lifecycleLines(t) {
		t.Logf("  daemon: %s", l)
	}

	var out []bootPhase
	phases := []struct {
		name     string
		from, to int64
	}{{"boot", 0, cuts[0]}, {"reboot", cuts[0], cuts[1]}, {"poweroff", cuts[1], -1}}
	for _, ph := range phases {
		msgs := e.d.vhostMessages(t, ph.from, ph.to)
		out = append(out, bootPhase{name: ph.name, msgs: msgs})
		var names, lines []string
		for _, m := range msgs {
			names = append(names, m.Request)
			lines = append(lines, m.String())
		}
		path := filepath.Join(e.dir, "vhost-user-"+ph.name+".txt")
		if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s vhost-user messages, %s (%d; %s): %s", q, ph.name, len(msgs), filepath.Base(path), compactSequence(names))
		for _, m := range msgs {
			if m.Refused != "" {
				t.Errorf("%s: the daemon refused %s", ph.name, m)
			}
		}
		if len(msgs) == 0 && ph.name != "poweroff" {
			t.Errorf("%s: no vhost-user message logged (is the daemon at --log-level debug?)", ph.name)
		}
	}

	if g.Boots != 2 {
		t.Fatalf("guest booted %d times, want 2", g.Boots)
	}
	inits := e.inits()
	if len(inits) != 2 {
		t.Fatalf("daemon log has %d INIT requests, want 2 (one per boot)", len(inits))
	}
	for boot := 1; boot <= 2; boot++ {
		e.checkBoot(g, boot, inits)
		for _, name := range []string{"fio", "fio-rm"} {
			if st := g.step(t, boot, name); st.RC != 0 {
				t.Errorf("boot %d: %s failed (rc=%d)\n%s", boot, name, st.RC, lastLines(st.Output, 20))
			}
		}
	}
	if len(g.Done) != 2 || g.Done[0] != "reboot" || g.Done[1] != "poweroff" {
		t.Errorf("guest E2E-DONE actions %v, want [reboot poweroff]", g.Done)
	}
	return e, out
}
