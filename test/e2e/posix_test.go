//go:build linux

package e2e

// The POSIX guest script (guest-scripts/posix.sh) side by side against the
// reference C daemon and ours: each run is checked in the guest (step rc,
// E2E-MISMATCH lines), from the host (the state left in the share), and the
// two runs' E2E-RESULT lines are compared.

import (
	"bytes"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
)

// intendedDifference is a result the two daemons are expected to give
// differently, with the exact value each one gives.
type intendedDifference struct {
	Kernels   []string // uname -r prefixes it applies to; none: every kernel
	Ours      string
	Reference string
	Reason    string
}

// intendedDifferences: E2E-RESULT keys whose values differ on purpose
// (README "Intended differences"). A listed difference that is not observed
// is only logged.
var intendedDifferences = map[string]intendedDifference{
	"tmpfile": {
		Ours:      "open=ok write=ok nlink_before=0 link=ok nlink_after=1 mode=600 size=8",
		Reference: "open=EOPNOTSUPP",
		Reason:    "the C daemon (QEMU 7.2) has no FUSE_TMPFILE: it answers ENOSYS and the guest kernel turns that into EOPNOTSUPP; ours implements O_TMPFILE",
	},
	"tmpfile.linked": {
		Ours: "tmp data", Reference: "missing",
		Reason: "follows from tmpfile: nothing to link with the C daemon",
	},
	"tmpfile.dir": {
		Ours: "linked", Reference: "",
		Reason: "follows from tmpfile",
	},
	"statx.btime": {
		Kernels: []string{"6.12.", "7."},
		Ours:    "btime=1 btime_ok=1", Reference: "btime=0 btime_ok=0",
		Reason: "Linux 6.12 and 7.x ask for the birth time with FUSE_STATX; the C daemon has no STATX (ENOSYS, the guest falls back to GETATTR without btime); ours answers it from the host's statx",
	},
}

// intendedDifferencesRust: as intendedDifferences, when the other daemon
// of the side by side is the Rust virtiofsd (TestQEMU11's posix subtest;
// Reference is then the Rust daemon's value).
// Seen with virtiofsd 1.14.0 and Linux 7.2 (TestQEMU11); the rest of
// posix.sh's 233 results match.
var intendedDifferencesRust = map[string]intendedDifference{
	"tmpfile": {
		Ours:      "open=ok write=ok nlink_before=0 link=ok nlink_after=1 mode=600 size=8",
		Reference: "open=EOPNOTSUPP",
		Reason:    "observed: O_TMPFILE fails with EOPNOTSUPP on the Rust virtiofsd 1.14 (as on the C daemon, which answers TMPFILE ENOSYS); ours implements O_TMPFILE",
	},
	"tmpfile.linked": {
		Ours: "tmp data", Reference: "missing",
		Reason: "follows from tmpfile",
	},
	"tmpfile.dir": {
		Ours: "linked", Reference: "",
		Reason: "follows from tmpfile",
	},
	"statx.btime": {
		Ours: "btime=1 btime_ok=1", Reference: "btime=0 btime_ok=0",
		Reason: "observed: no birth time through the Rust virtiofsd 1.14 (Linux 7.x asks with FUSE_STATX and falls back to GETATTR, which has none); ours answers STATX from the host's statx",
	},
	"killpriv.write": {
		Ours: "777 k|x", Reference: "6777 k|x",
		Reason: "observed: after a write by uid 1000 to root's 06777 file, ours (as the C daemon and a local file system) has cleared set-user-ID and set-group-ID; with the Rust virtiofsd 1.14 (--cache never) both stay (host check killpriv likewise)",
	},
	"remount.fingerprint": {
		Ours: "acbe509e3a5ba76ebb4799fa170ec6ee", Reference: "d10b0578fb3bb8044995b020875b1852",
		Reason: "follows from killpriv.write: kp1's mode is part of the fingerprint",
	},
}

// rustHostDifferences: host checks (checkHost) the Rust virtiofsd fails on
// purpose, by the reason in intendedDifferencesRust.
var rustHostDifferences = map[string]string{
	"killpriv": "killpriv.write",
}

// KnownFailures: checks that fail with our daemon because of a daemon bug
// reported to the lead. Keys are E2E-RESULT keys (guest checks and the
// side-by-side comparison), "host.NAME" (host-side checks) or "log.NAME"
// (daemon log checks). The test logs them instead of failing; a listed check
// that passes is logged too, so the entry can be removed. Empty when the
// daemon has no known bug.
var KnownFailures = map[string]string{}

// posixSteps are the steps posix.sh runs, in order.
var posixSteps = []string{
	"setup", "create", "otrunc", "oappend", "oexcl", "sparse", "truncate", "rename", "hardlink",
	"symlink", "attrs", "killpriv", "creds", "errors", "mmap", "fifo", "mknod", "unlink_open", "readdir", "xattr", "seek", "fallocate",
	"copy_file_range", "sync", "tmpfile", "statx", "statfs", "remount",
}

// Directory sizes for posix.sh: the host puts posixListing empty files in
// listing/ before the boot (the guest lists them); the guest itself creates
// posixMany() files in posix/many with one fsops call and posixLoop() with a
// shell loop. A create costs ~6-9 ms under TCG (4 FUSE round trips), so the
// guest creates 10,000 only with GOVIRTIOFSD_E2E_FULL=1.
const posixListing = 10000

func posixMany() int {
	if fullE2E() {
		return 10000
	}
	return 1000
}

func posixLoop() int {
	if fullE2E() {
		return 1000
	}
	return 200
}

var (
	reResult   = regexp.MustCompile(`E2E-RESULT (\S+) ?(.*)$`)
	reMismatch = regexp.MustCompile(`E2E-MISMATCH (\S+) (.*)$`)
	reTime     = regexp.MustCompile(`E2E-TIME (\S+) (\d+)`)
)

func fullE2E() bool { return os.Getenv("GOVIRTIOFSD_E2E_FULL") == "1" }

// sideBySideKernels: Linux 6.1 only, or every kernel with GOVIRTIOFSD_E2E_FULL=1.
func sideBySideKernels(t *testing.T) []guestKernel {
	t.Helper()
	all := guestKernels(t)
	if fullE2E() {
		return all
	}
	for _, k := range all {
		if strings.HasPrefix(k.Version, "6.1.") {
			return []guestKernel{k}
		}
	}
	return all[:1]
}

func requireReference(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(launch.ReferenceBin); err != nil {
		t.Fatalf("reference daemon: %v (make deps installs qemu-system-common)", err)
	}
}

// posixRun is one run of posix.sh against one daemon.
type posixRun struct {
	kind     daemonKind
	peer     daemonKind // the other daemon of the side by side (refDaemon unless set)
	kernel   guestKernel
	env      *env
	vm       *vm
	guest    guestRun
	results  map[string]string
	order    []string
	mismatch map[string]string // key -> "got=[..] want=[..]"
	times    map[string]int    // E2E-TIME, ms
	steps    map[string]time.Duration
}

func daemonArgs(kind daemonKind) []string {
	if kind == refDaemon {
		return []string{"-o", "xattr"}
	}
	return []string{"--cache", "never", "--xattr"}
}

// posixShare is what both daemons of a side-by-side comparison serve, and
// how; the zero value: a fresh directory of the test's temporary
// directory, the daemons as daemonArgs says, one run after the other.
type posixShare struct {
	// overlay: an overlayfs as a container's root (mountOverlay:
	// lower, upper and work on a tmpfs, nfs_export off, so no file
	// handles), with listing/ in its lower layer.
	overlay bool
	// budget: our daemon's --inode-fd-budget (0: not given), and
	// checkBudgetLog on its log.
	budget int
	// parallel: the two runs boot at once (always with
	// GOVIRTIOFSD_E2E_FULL=1).
	parallel bool
}

// makePosixListing makes dir/listing, posixListing empty files.
func makePosixListing(t *testing.T, dir string) {
	t.Helper()
	listing := filepath.Join(dir, "listing")
	if err := os.Mkdir(listing, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range posixListing {
		f, err := os.Create(filepath.Join(listing, fmt.Sprintf("f%05d", i)))
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
}

// runPosix runs posix.sh against one daemon serving share; base sets the
// QEMU and the ring layout (the zero value: QEMU 7.2, split rings).
func runPosix(t *testing.T, kind daemonKind, k guestKernel, base vmConfig, share posixShare) *posixRun {
	t.Helper()
	args := daemonArgs(kind)
	if kind == ourDaemon && share.budget > 0 {
		args = append(args, "--inode-fd-budget", strconv.Itoa(share.budget))
	}
	var e *env
	if share.overlay {
		merged := t.TempDir()
		mountOverlay(t, merged, func(lower string) { makePosixListing(t, lower) })
		e = newEnvAt(t, kind, k, merged, args...)
	} else {
		e = newEnv(t, kind, k, args...)
		makePosixListing(t, e.shared)
	}
	start := time.Now()
	cfg := base
	cfg.Script, cfg.Timeout = "posix", 8*time.Minute
	cfg.Append = append(slices.Clone(cfg.Append), "e2e.posixmany="+strconv.Itoa(posixMany()), "e2e.posixloop="+strconv.Itoa(posixLoop()),
		"e2e.posixlisting="+strconv.Itoa(posixListing))
	v := e.start(cfg)
	v.waitExit()
	e.daemonExit(v, true)
	r := &posixRun{kind: kind, kernel: k, env: e, vm: v, results: map[string]string{},
		mismatch: map[string]string{}, times: map[string]int{}, steps: v.stepDurations()}
	lines := v.consoleLines()
	r.guest = parseConsole(lines)
	for _, l := range lines {
		if m := reResult.FindStringSubmatch(l); m != nil {
			if _, dup := r.results[m[1]]; dup {
				t.Errorf("%s: result %s printed twice", kind, m[1])
			}
			r.results[m[1]] = m[2]
			r.order = append(r.order, m[1])
		} else if m := reMismatch.FindStringSubmatch(l); m != nil {
			r.mismatch[m[1]] = m[2]
		} else if m := reTime.FindStringSubmatch(l); m != nil {
			r.times[m[1]], _ = strconv.Atoi(m[2])
		}
	}
	t.Logf("%s on %s (%s, %s): QEMU ran %.1fs (test %.1fs), %d results, %d guest mismatches; logs in %s",
		kind, k.Version, cfg.QEMU, ringLayout(lines), v.ExitTime().Sub(v.started).Seconds(), time.Since(start).Seconds(),
		len(r.results), len(r.mismatch), e.dir)
	return r
}

// known reports (and logs) whether key is a known failure of our daemon.
func known(t *testing.T, kind daemonKind, key, what string) bool {
	t.Helper()
	if kind != ourDaemon {
		return false
	}
	if reason, ok := KnownFailures[key]; ok {
		t.Logf("KNOWN FAILURE %s: %s (%s)", key, what, reason)
		return true
	}
	return false
}

// intendedFor returns the intended difference for key on kernel k when the
// other daemon is peer (ourDaemon, the zero value, stands for refDaemon).
func intendedFor(key string, k guestKernel, peer daemonKind) (intendedDifference, bool) {
	m := intendedDifferences
	if peer == rustDaemon || peer == rust114Daemon {
		m = intendedDifferencesRust
	}
	d, ok := m[key]
	if !ok {
		return d, false
	}
	if len(d.Kernels) == 0 {
		return d, true
	}
	for _, p := range d.Kernels {
		if strings.HasPrefix(k.Version, p) {
			return d, true
		}
	}
	return d, false
}

// checkGuest: every step ran and passed its in-guest checks, except
// mismatches that are an intended difference (with this daemon's listed
// value) or a known failure of ours.
func checkGuest(t *testing.T, r *posixRun) {
	t.Helper()
	ran := map[string]guestStep{}
	for _, s := range r.guest.Steps {
		ran[s.Name] = s
	}
	for _, name := range append([]string{"mount"}, posixSteps...) {
		if _, ok := ran[name]; !ok {
			t.Errorf("%s: step %s did not run (guest stopped early?)\n%s", r.kind, name, lastLines(r.vm.consoleLines(), 30))
		}
	}
	for _, s := range r.guest.Steps {
		if s.RC == 0 {
			continue
		}
		var uncovered []string
		for _, l := range s.Output {
			m := reMismatch.FindStringSubmatch(l)
			if m == nil {
				continue
			}
			key, got := m[1], r.results[m[1]]
			peer := r.peer
			if r.kind != ourDaemon {
				peer = r.kind
			}
			if d, ok := intendedFor(key, r.kernel, peer); ok {
				want := d.Ours
				if r.kind != ourDaemon {
					want = d.Reference
				}
				if got == want {
					continue
				}
			}
			if known(t, r.kind, key, "guest check: "+m[2]) {
				continue
			}
			uncovered = append(uncovered, key+" "+m[2])
		}
		if len(uncovered) > 0 || !slices.ContainsFunc(s.Output, reMismatch.MatchString) {
			t.Errorf("%s: guest step %s rc=%d:\n  %s\n  output:\n%s", r.kind, s.Name, s.RC,
				strings.Join(uncovered, "\n  "), lastLines(s.Output, 40))
		}
	}
	for key := range KnownFailures {
		if r.kind == ourDaemon && !strings.HasPrefix(key, "host.") && !strings.HasPrefix(key, "log.") {
			if _, bad := r.mismatch[key]; !bad {
				if _, seen := r.results[key]; seen {
					t.Logf("known failure %s passes in the guest now: remove it from KnownFailures if the comparison agrees", key)
				}
			}
		}
	}
}

// comparePosix compares the E2E-RESULT lines of the two runs.
func comparePosix(t *testing.T, k guestKernel, ours, ref *posixRun) {
	t.Helper()
	keys := map[string]bool{}
	for key := range ours.results {
		keys[key] = true
	}
	for key := range ref.results {
		keys[key] = true
	}
	sorted := make([]string, 0, len(keys))
	for key := range keys {
		sorted = append(sorted, key)
	}
	sort.Strings(sorted)
	show := func(v string, ok bool) string {
		if !ok {
			return "(no result)"
		}
		return strconv.Quote(v)
	}
	matched, intended, differ := 0, 0, 0
	for _, key := range sorted {
		o, okO := ours.results[key]
		r, okR := ref.results[key]
		d, isIntended := intendedFor(key, k, ref.kind)
		if okO && okR && o == r {
			matched++
			if isIntended {
				t.Logf("intended difference %s not observed: both %q", key, o)
			}
			continue
		}
		if isIntended {
			if okO && okR && o == d.Ours && r == d.Reference {
				intended++
				t.Logf("intended difference %s: ours %s, reference %s — %s", key, show(o, okO), show(r, okR), d.Reason)
				continue
			}
			t.Errorf("%s: intended difference changed: ours %s (listed %q), reference %s (listed %q)",
				key, show(o, okO), d.Ours, show(r, okR), d.Reference)
			differ++
			continue
		}
		if known(t, ourDaemon, key, fmt.Sprintf("ours %s, reference %s", show(o, okO), show(r, okR))) {
			differ++
			continue
		}
		t.Errorf("result %s differs: ours %s, reference %s", key, show(o, okO), show(r, okR))
		differ++
	}
	t.Logf("side by side on %s: %d results matched, %d intended differences, %d other differences",
		k.Version, matched, intended, differ)

	// Timings (log only).
	names := map[string]bool{}
	for n := range ours.times {
		names[n] = true
	}
	for n := range ref.times {
		names[n] = true
	}
	var tn []string
	for n := range names {
		tn = append(tn, n)
	}
	sort.Strings(tn)
	for _, n := range tn {
		o, r := ours.times[n], ref.times[n]
		t.Logf("  guest time %-32s ours %6d ms  reference %6d ms  ratio %s", n, o, r, ratio(float64(o), float64(r)))
	}
	for _, s := range posixSteps {
		o, r := ours.steps[s], ref.steps[s]
		t.Logf("  step %-16s ours %6.2fs  reference %6.2fs  ratio %s", s, o.Seconds(), r.Seconds(), ratio(o.Seconds(), r.Seconds()))
	}
}

func ratio(a, b float64) string {
	if b == 0 {
		return "-"
	}
	return strconv.FormatFloat(a/b, 'f', 2, 64)
}

// TestPosixSideBySide runs posix.sh against the reference C daemon and ours
// (Linux 6.1; every kernel with GOVIRTIOFSD_E2E_FULL=1) and checks each run
// in the guest and from the host, then compares the two.
func TestPosixSideBySide(t *testing.T) {
	requireE2E(t)
	requireReference(t)
	for _, k := range sideBySideKernels(t) {
		t.Run(k.Version, func(t *testing.T) { posixSideBySide(t, k, vmConfig{}, posixShare{}) })
	}
}

// posixBudget is TestPosixSideBySideOverlayBudget's --inode-fd-budget: the
// least the daemon takes, so that eviction and reopening run on almost
// every request.
const posixBudget = 16

// TestPosixSideBySideOverlayBudget (issue 31) runs posix.sh side by side
// as TestPosixSideBySide does, on an overlayfs share as a container's
// root (lower, upper and work on a tmpfs, nfs_export off: no file
// handles, so ours holds every inode as an fd under the default
// --inode-file-handles) with our daemon at --inode-fd-budget 16. The
// reference serves the same kind of share, so the comparison is like for
// like (on overlayfs some results differ from tmpfs's). One kernel, Linux
// 6.12 under QEMU 10; the two runs boot at once. Our daemon's log must
// say the budget was reached, and no request may have failed with ESTALE
// (nothing changes the share behind the guest's back). Skipped while the
// daemon's --help has no --inode-fd-budget.
func TestPosixSideBySideOverlayBudget(t *testing.T) {
	requireE2E(t)
	requireReference(t)
	if !hasFDBudget(t) {
		t.Skip("the daemon's --help has no --inode-fd-budget")
	}
	k := newestKernelAtLeast(t, 6, 12, "the side-by-side on overlayfs runs under QEMU 10, which runs Linux 6.12 guests only")
	share := posixShare{overlay: true, budget: posixBudget, parallel: true}
	t.Run(k.Version, func(t *testing.T) { posixSideBySide(t, k, vmConfig{QEMU: qemu10}, share) })
}

// checkBudgetLog: our daemon reached its fd budget (it says so once) and
// never ran out of fds; no request failed with ESTALE.
func checkBudgetLog(t *testing.T, r *posixRun, budget int) {
	t.Helper()
	data, err := os.ReadFile(r.env.d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	var reached, outOfFDs int
	for _, line := range strings.Split(string(data), "\n") {
		msg := parseLogfmt(line)["msg"]
		if strings.Contains(msg, "inode fd budget reached") {
			reached++
			t.Logf("daemon: %s", line)
		}
		if strings.Contains(msg, "out of file descriptors") {
			outOfFDs++
		}
	}
	if reached == 0 && !known(t, r.kind, "log.budget", "no \"inode fd budget reached\" line") {
		t.Errorf("daemon log: no \"inode fd budget reached\" line: the budget of %d was never reached", budget)
	}
	if outOfFDs != 0 && !known(t, r.kind, "log.fds", "\"out of file descriptors\" in the log") {
		t.Errorf("daemon log: %d \"out of file descriptors\" lines", outOfFDs)
	}
	estale := 0
	for _, q := range r.env.d.fuseRequests(t) {
		if q.Error == -int(syscall.ESTALE) {
			estale++
		}
	}
	if estale != 0 && !known(t, r.kind, "log.estale", "requests answered ESTALE") {
		t.Errorf("daemon log: %d requests answered ESTALE (a reopen by name failed, with nothing changing the share on the host)", estale)
	}
}

// posixSideBySide runs posix.sh against the reference and ours on kernel k,
// checks each run and compares the two. base sets the QEMU and the ring
// layout of both guests (the zero value: QEMU 7.2, split rings). With
// base.Packed ours must have negotiated packed rings (requirePacked); the
// reference C daemon does not offer them, so QEMU gives it split rings
// (logged): the comparison is then ours on packed rings against the
// reference on split ones, under the same QEMU and command line.
//
// share says what both daemons serve (and with share.budget, ours's
// log also gets checkBudgetLog).
func posixSideBySide(t *testing.T, k guestKernel, base vmConfig, share posixShare) {
	posixSideBySideWith(t, refDaemon, k, base, share)
}

// posixSideBySideWith is posixSideBySide with peer (refDaemon or a Rust
// daemon) as the other daemon; its subtest is named "reference" for the C
// daemon, "rust" or "rust-1.14" for the Rust daemons.
func posixSideBySideWith(t *testing.T, peer daemonKind, k guestKernel, base vmConfig, share posixShare) {
	var ref, ours *posixRun
	peerName := "reference"
	switch peer {
	case rustDaemon:
		peerName = "rust"
	case rust114Daemon:
		peerName = "rust-1.14"
	}
	// With GOVIRTIOFSD_E2E_FULL=1 (10,000 guest-made files: ~3 min a
	// run) both runs boot at the same time; the guests wait on FUSE
	// round trips most of the time, so this nearly halves the wall
	// time, at the price of noisier timings.
	t.Run("runs", func(t *testing.T) {
		t.Run(peerName, func(t *testing.T) {
			if fullE2E() || share.parallel {
				t.Parallel()
			}
			ref = runPosix(t, peer, k, base, share)
			checkGuest(t, ref)
			checkHost(t, ref)
		})
		t.Run("govirtiofsd", func(t *testing.T) {
			if fullE2E() || share.parallel {
				t.Parallel()
			}
			r := runPosix(t, ourDaemon, k, base, share)
			r.peer = peer
			if base.Packed {
				requirePacked(t, r.vm.consoleLines(), 1)
			}
			ours = r
			checkGuest(t, ours)
			checkHost(t, ours)
			checkDaemonLog(t, ours)
			if share.budget > 0 {
				checkBudgetLog(t, ours, share.budget)
			}
		})
	})
	if ref == nil || ours == nil {
		t.Fatal("a run did not complete; nothing to compare")
	}
	comparePosix(t, k, ours, ref)
}

// ---------------------------------------------------------------------------
// Our daemon's log: the operations the script is meant to exercise reached it
// and succeeded at least once.

func checkDaemonLog(t *testing.T, r *posixRun) {
	t.Helper()
	reqs := r.env.d.fuseRequests(t)
	type count struct{ n, ok int }
	hist := map[string]*count{}
	errs := map[string]map[int]int{}
	for _, q := range reqs {
		c := hist[q.Opcode]
		if c == nil {
			c = &count{}
			hist[q.Opcode] = c
		}
		c.n++
		if q.Error == 0 {
			c.ok++
		} else {
			if errs[q.Opcode] == nil {
				errs[q.Opcode] = map[int]int{}
			}
			errs[q.Opcode][q.Error]++
		}
	}
	var ops []string
	for op := range hist {
		ops = append(ops, op)
	}
	sort.Strings(ops)
	var sb strings.Builder
	for _, op := range ops {
		fmt.Fprintf(&sb, " %s=%d", op, hist[op].n)
		if e := errs[op]; len(e) > 0 {
			var es []string
			for errno, n := range e {
				es = append(es, fmt.Sprintf("%s×%d", errnoName(errno), n))
			}
			sort.Strings(es)
			fmt.Fprintf(&sb, "(%s)", strings.Join(es, ","))
		}
	}
	t.Logf("daemon: %d FUSE requests:%s", len(reqs), sb.String())
	want := []string{"INIT", "LOOKUP", "GETATTR", "SETATTR", "CREATE", "OPEN", "READ", "WRITE", "FLUSH",
		"RELEASE", "MKDIR", "RMDIR", "UNLINK", "RENAME2", "LINK", "SYMLINK", "READLINK", "MKNOD",
		"OPENDIR", "RELEASEDIR", "SETXATTR", "GETXATTR", "LISTXATTR", "REMOVEXATTR", "LSEEK",
		"FALLOCATE", "FSYNC", "SYNCFS", "TMPFILE", "STATFS", "DESTROY"}
	if strings.HasPrefix(r.kernel.Version, "6.12.") || kernelAtLeast(r.kernel.Version, 7, 0) {
		want = append(want, "STATX")
	}
	// Linux 7.x copies with COPY_FILE_RANGE_64 first (FUSE 7.45), which
	// ours serves: it never falls back to COPY_FILE_RANGE.
	if kernelAtLeast(r.kernel.Version, 7, 0) {
		want = append(want, "COPY_FILE_RANGE_64")
	} else {
		want = append(want, "COPY_FILE_RANGE")
	}
	for _, op := range want {
		if c := hist[op]; c == nil || c.ok == 0 {
			if !known(t, r.kind, "log."+op, "no successful "+op+" in the daemon log") {
				t.Errorf("daemon log: no successful %s request (seen %v)", op, c)
			}
		}
	}
	if c := hist["READDIR"]; c == nil {
		if c = hist["READDIRPLUS"]; c == nil {
			t.Errorf("daemon log: no READDIR or READDIRPLUS")
		}
	}
	// umount + mount in the script: a second session.
	if c := hist["INIT"]; c == nil || c.ok < 2 {
		if !known(t, r.kind, "log.INIT", "want 2 successful INITs (mount, remount)") {
			t.Errorf("daemon log: %v successful INIT, want 2 (mount, then the script's remount)", c)
		}
	}
}

func errnoName(neg int) string {
	e := syscall.Errno(-neg)
	if n := unix.ErrnoName(e); n != "" {
		return n
	}
	return strconv.Itoa(neg)
}

// ---------------------------------------------------------------------------
// Host-side checks: the state the guest left in the share.

type hostCheck struct {
	root string // share/posix
	errs []string
}

func (h *hostCheck) errorf(format string, args ...any) {
	h.errs = append(h.errs, fmt.Sprintf(format, args...))
}

func (h *hostCheck) lstat(rel string) (*unix.Stat_t, bool) {
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(h.root, rel), &st); err != nil {
		h.errorf("%s: %v", rel, err)
		return nil, false
	}
	return &st, true
}

func (h *hostCheck) content(rel, want string) {
	got, err := os.ReadFile(filepath.Join(h.root, rel))
	if err != nil {
		h.errorf("%s: %v", rel, err)
		return
	}
	if string(got) != want {
		if len(got) > 64 {
			got = append(got[:64:64], "..."...)
		}
		h.errorf("%s: content %q, want %q", rel, got, want)
	}
}

func (h *hostCheck) md5(rel, want string) {
	data, err := os.ReadFile(filepath.Join(h.root, rel))
	if err != nil {
		h.errorf("%s: %v", rel, err)
		return
	}
	sum := md5.Sum(data)
	if got := hex.EncodeToString(sum[:]); got != want {
		h.errorf("%s: md5 %s, want %s (as the guest saw it)", rel, got, want)
	}
}

// file checks type, permission bits (07777), link count and size (-1: any).
func (h *hostCheck) file(rel string, typ uint32, perm uint32, nlink uint64, size int64) *unix.Stat_t {
	st, ok := h.lstat(rel)
	if !ok {
		return nil
	}
	if st.Mode&unix.S_IFMT != typ {
		h.errorf("%s: type %#o, want %#o", rel, st.Mode&unix.S_IFMT, typ)
	}
	if perm != ^uint32(0) && st.Mode&0o7777 != perm {
		h.errorf("%s: mode %#o, want %#o", rel, st.Mode&0o7777, perm)
	}
	if nlink != 0 && uint64(st.Nlink) != nlink {
		h.errorf("%s: nlink %d, want %d", rel, st.Nlink, nlink)
	}
	if size >= 0 && st.Size != size {
		h.errorf("%s: size %d, want %d", rel, st.Size, size)
	}
	return st
}

const anyPerm = ^uint32(0)

func (h *hostCheck) absent(rel string) {
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(h.root, rel), &st); !errors.Is(err, unix.ENOENT) {
		h.errorf("%s: exists (err %v), want it gone", rel, err)
	}
}

func (h *hostCheck) symlink(rel, target string) {
	got, err := os.Readlink(filepath.Join(h.root, rel))
	if err != nil {
		h.errorf("%s: %v", rel, err)
	} else if got != target {
		h.errorf("%s: symlink to %q, want %q", rel, got, target)
	}
}

func (h *hostCheck) owner(rel string, uid, gid uint32) {
	if st, ok := h.lstat(rel); ok && (st.Uid != uid || st.Gid != gid) {
		h.errorf("%s: owner %d:%d, want %d:%d", rel, st.Uid, st.Gid, uid, gid)
	}
}

func (h *hostCheck) xattr(rel, name, want string) {
	buf := make([]byte, 4096)
	n, err := unix.Lgetxattr(filepath.Join(h.root, rel), name, buf)
	if want == "" {
		if !errors.Is(err, unix.ENODATA) {
			h.errorf("%s: xattr %s: %q, %v; want none", rel, name, buf[:max(n, 0)], err)
		}
		return
	}
	if err != nil {
		h.errorf("%s: xattr %s: %v, want %q", rel, name, err, want)
	} else if string(buf[:n]) != want {
		h.errorf("%s: xattr %s = %q, want %q", rel, name, buf[:n], want)
	}
}

func (h *hostCheck) seek(rel string, whence int, off, want int64) {
	f, err := os.Open(filepath.Join(h.root, rel))
	if err != nil {
		h.errorf("%s: %v", rel, err)
		return
	}
	defer f.Close()
	got, err := unix.Seek(int(f.Fd()), off, whence)
	if want < 0 {
		if !errors.Is(err, unix.ENXIO) {
			h.errorf("%s: lseek(%d, %d) = %d, %v; want ENXIO", rel, off, whence, got, err)
		}
		return
	}
	if err != nil || got != want {
		h.errorf("%s: lseek(%d, whence %d) = %d, %v; want %d", rel, off, whence, got, err, want)
	}
}

// checkHost inspects the share after the guest has finished. Some checks
// follow what the guest reported (e.g. whether O_TMPFILE worked), since the
// side-by-side comparison judges those results.
func checkHost(t *testing.T, r *posixRun) {
	t.Helper()
	root := filepath.Join(r.env.shared, "posix")
	res := r.results
	checks := []struct {
		name string
		fn   func(h *hostCheck)
	}{
		{"create", func(h *hostCheck) {
			h.content("a", "heXYo\nworld\n")
			h.file("a", unix.S_IFREG, 0o644, 1, 12)
			h.file("big", unix.S_IFREG, 0o644, 1, 1048577)
			h.md5("big", res["create.big.md5"])
		}},
		{"otrunc", func(h *hostCheck) { h.file("t", unix.S_IFREG, 0o644, 1, 0) }},
		{"oappend", func(h *hostCheck) { h.content("app", "one\n\x00\x00\x00\x00\x00\x00ZZtwo\n") }},
		{"oexcl", func(h *hostCheck) {
			h.file("ex", unix.S_IFREG, 0o644, 1, 0)
			h.symlink("ex-link", "ex")
			h.symlink("ex-dangling", "nowhere")
			h.absent("nowhere")
		}},
		{"sparse", func(h *hostCheck) {
			if st := h.file("sparse", unix.S_IFREG, 0o644, 1, 10485764); st != nil && st.Blocks*512 >= 1<<20 {
				h.errorf("sparse: %d blocks allocated, want a hole", st.Blocks)
			}
			h.seek("sparse", unix.SEEK_DATA, 0, 10485760)
		}},
		{"truncate", func(h *hostCheck) { h.content("tr", "he") }},
		{"rename", func(h *hostCheck) {
			h.content("r2/c", "A\n")
			h.content("r2/y", "X\n")
			h.content("r2/z", "Y\n")
			h.content("r2/sub/f", "D\n")
			h.content("r2/empty/s", "S\n")
			for _, gone := range []string{"r1/a", "r1/b", "r1/x", "r1/sub", "r1/d2"} {
				h.absent(gone)
			}
			if ents, err := os.ReadDir(filepath.Join(h.root, "r1")); err != nil || len(ents) != 0 {
				h.errorf("r1: %d entries, %v; want empty", len(ents), err)
			}
		}},
		{"hardlink", func(h *hostCheck) {
			a := h.file("h", unix.S_IFREG, 0o644, 2, -1)
			b := h.file("r2/h2", unix.S_IFREG, 0o644, 2, -1)
			if a != nil && b != nil && (a.Ino != b.Ino || a.Dev != b.Dev) {
				h.errorf("h and r2/h2 are different inodes")
			}
			h.content("h", "linked\nmore\n")
			h.absent("h1")
			h.absent("r1link")
		}},
		{"symlink", func(h *hostCheck) {
			h.symlink("sl", "st")
			h.symlink("sldir", "../posix/r2")
			h.symlink("slabs", "/nonexistent/abs")
			h.symlink("sllong", strings.Repeat("x", 1000))
			h.owner("sl", 2222, 3333)
			h.symlink("sl-hard", "st")
			if st := h.file("sl", unix.S_IFLNK, anyPerm, 2, 2); st != nil && st.Mtim.Sec != 1083827289 {
				h.errorf("sl: symlink mtime %d, want 1083827289", st.Mtim.Sec)
			}
			h.owner("st", 0, 0)
			h.content("st", "target\n")
		}},
		{"attrs", func(h *hostCheck) {
			if st := h.file("m", unix.S_IFREG, 0o600, 1, -1); st != nil && st.Mtim.Sec != 1015218367 {
				h.errorf("m: mtime %d, want 1015218367", st.Mtim.Sec)
			}
			h.owner("m", 1234, 4321)
			h.file("dmode", unix.S_IFDIR, 0o1777, 0, -1)
			h.file("priv", unix.S_IFREG, 0o644, 1, 7)
		}},
		{"killpriv", func(h *hostCheck) {
			h.file("kp1", unix.S_IFREG, 0o777, 1, -1)
			h.content("kp1", "k\nx\n")
			h.file("kp2", unix.S_IFREG, 0o777, 1, 1)
			h.file("kp3", unix.S_IFREG, 0o2767, 1, -1)
			h.file("kp4", unix.S_IFREG, 0o6755, 1, -1)
			h.file("kp5", unix.S_IFREG, 0o777, 1, 0)
			if strings.HasPrefix(res["killpriv.open_trunc"], "777 ") {
				h.file("kp6", unix.S_IFREG, 0o777, 1, 0)
			} else {
				h.file("kp6", unix.S_IFREG, 0o6777, 1, 0)
			}
		}},
		{"creds", func(h *hostCheck) {
			h.content("pub/file", "mine\n")
			for _, n := range []string{"pub/file", "pub/dir", "pub/sym", "pub/fifo"} {
				h.owner(n, 1000, 1001)
			}
			h.file("pub/fifo", unix.S_IFIFO, anyPerm, 1, 0)
			h.symlink("pub/sym", "file")
			h.file("sg/file", unix.S_IFREG, 0o644, 1, -1)
			h.owner("sg/file", 1000, 5678)
			h.file("sg/dir", unix.S_IFDIR, 0o2755, 0, -1)
			h.owner("sg/dir", 1000, 5678)
			h.file("um-file", unix.S_IFREG, 0o600, 1, 0)
			h.file("um-dir", unix.S_IFDIR, 0o700, 0, -1)
			h.file("pub/rootfile", unix.S_IFREG, 0o666, 1, 0)
			h.owner("pub/rootfile", 0, 0)
		}},
		{"errors", func(h *hostCheck) {
			want := []string{"...", ".hidden", "-dash", "back\\slash", "dir", "file", "full", strings.Repeat("n", 255),
				"new\nline", "tab\tin", "with space", "é-ü-😀"}
			ents, err := os.ReadDir(filepath.Join(h.root, "e"))
			if err != nil {
				h.errorf("e: %v", err)
				return
			}
			var got []string
			for _, e := range ents {
				got = append(got, e.Name())
			}
			sort.Strings(want)
			if !slices.Equal(got, want) {
				h.errorf("e: entries %q, want %q", got, want)
			}
			h.content("e/new\nline", "new\nline")
			h.content("e/é-ü-😀", "é-ü-😀")
			h.file("e/dir", unix.S_IFDIR, 0o755, 2, -1)
		}},
		{"fifo", func(h *hostCheck) {
			h.file("fifo", unix.S_IFIFO, anyPerm, 1, 0)
			h.file("fifo2", unix.S_IFIFO, anyPerm, 1, 0)
		}},
		{"mknod", func(h *hostCheck) {
			if st := h.file("chr", unix.S_IFCHR, 0o666, 1, -1); st != nil && (unix.Major(st.Rdev) != 1 || unix.Minor(st.Rdev) != 5) {
				h.errorf("chr: rdev %d:%d, want 1:5", unix.Major(st.Rdev), unix.Minor(st.Rdev))
			}
			if st := h.file("blk", unix.S_IFBLK, 0o600, 1, -1); st != nil && (unix.Major(st.Rdev) != 7 || unix.Minor(st.Rdev) != 0) {
				h.errorf("blk: rdev %d:%d, want 7:0", unix.Major(st.Rdev), unix.Minor(st.Rdev))
			}
		}},
		{"unlink_open", func(h *hostCheck) {
			h.absent("uo")
			h.absent("uo2")
			h.absent("uo4")
			h.content("uo3", "new\n")
		}},
		{"readdir", func(h *hostCheck) {
			for dir, n := range map[string]int{"many": posixMany(), "../listing": posixListing} {
				ents, err := os.ReadDir(filepath.Join(h.root, dir))
				if err != nil {
					h.errorf("%s: %v", dir, err)
					continue
				}
				if len(ents) != n {
					h.errorf("%s: %d entries, want %d", dir, len(ents), n)
				}
				for i, e := range ents { // ReadDir sorts by name
					if want := fmt.Sprintf("f%05d", i); e.Name() != want || !e.Type().IsRegular() {
						h.errorf("%s: entry %d is %q (%v), want regular file %q", dir, i, e.Name(), e.Type(), want)
						break
					}
				}
			}
			h.absent("loop")
			h.file("empty", unix.S_IFDIR, 0o755, 2, -1)
		}},
		{"xattr", func(h *hostCheck) {
			h.xattr("xa", "user.test", "value2")
			h.xattr("xa", "user.keep", "kept")
			h.xattr("xa", "user.other", "")
			h.xattr("xa", "user.big", "")
			h.xattr("xdir", "user.dir", "dirval")
			if res["xattr.trusted"] == "ok" {
				h.xattr("xa", "trusted.test", "tval")
			} else {
				h.xattr("xa", "trusted.test", "")
			}
		}},
		{"seek", func(h *hostCheck) {
			h.file("holes", unix.S_IFREG, 0o644, 1, 2097152)
			h.seek("holes", unix.SEEK_HOLE, 0, 4096)
			h.seek("holes", unix.SEEK_DATA, 4096, 1048576)
			h.seek("holes", unix.SEEK_DATA, 1052672, -1)
		}},
		{"fallocate", func(h *hostCheck) {
			if st := h.file("fa", unix.S_IFREG, 0o644, 1, 1048576); st != nil && st.Blocks != 3840 {
				h.errorf("fa: %d blocks, want 3840 (2 MiB allocated, 128 KiB punched)", st.Blocks)
			}
			h.seek("fa", unix.SEEK_HOLE, 0, 65536)
			h.seek("fa", unix.SEEK_DATA, 65536, 196608)
		}},
		{"copy_file_range", func(h *hostCheck) {
			cs, err1 := os.ReadFile(filepath.Join(h.root, "cs"))
			cd, err2 := os.ReadFile(filepath.Join(h.root, "cd"))
			cd2, err3 := os.ReadFile(filepath.Join(h.root, "cd2"))
			if err := errors.Join(err1, err2, err3); err != nil {
				h.errorf("%v", err)
				return
			}
			if len(cs) != 300000 || !bytes.Equal(cs, cd) {
				h.errorf("cd (%d bytes) differs from cs (%d bytes)", len(cd), len(cs))
			}
			if len(cd2) != 4196 || !bytes.Equal(cd2[:100], make([]byte, 100)) || !bytes.Equal(cd2[100:], cs[8192:8192+4096]) {
				h.errorf("cd2: %d bytes, not 100 zeros + cs[8192:12288]", len(cd2))
			}
			h.file("cd3", unix.S_IFREG, 0o644, 1, 0)
		}},
		{"sync", func(h *hostCheck) { h.content("sy", "synced\n") }},
		{"tmpfile", func(h *hostCheck) {
			if strings.HasPrefix(res["tmpfile"], "open=ok") {
				h.content("tmpd/linked", "tmp data")
				h.file("tmpd/linked", unix.S_IFREG, 0o600, 1, 8)
			} else if ents, err := os.ReadDir(filepath.Join(h.root, "tmpd")); err != nil || len(ents) != 0 {
				h.errorf("tmpd: %d entries, %v; want none (O_TMPFILE failed in the guest)", len(ents), err)
			}
		}},
		{"statx", func(h *hostCheck) {
			if st := h.file("sx", unix.S_IFREG, 0o604, 1, 5); st != nil && st.Mtim.Sec != 1262401445 {
				h.errorf("sx: mtime %d, want 1262401445", st.Mtim.Sec)
			}
		}},
		{"remount", func(h *hostCheck) { h.content("after", "after\n") }},
		{"nothing_else", func(h *hostCheck) {
			// Every top-level name is one the script made.
			want := map[string]bool{}
			for _, n := range strings.Fields(`a big t app ex ex-link ex-dangling sparse tr r1 r2 h sl sldir
				slabs sllong st m dmode priv fifo fifo2 chr blk uo3 many empty xa xdir holes fa cs cd cd2 cd3 sy
				tmpd sx after kp1 kp2 kp3 kp4 kp5 kp6 sl-hard pub sg um-file um-dir e mm`) {
				want[n] = true
			}
			ents, err := os.ReadDir(h.root)
			if err != nil {
				h.errorf("%v", err)
				return
			}
			for _, e := range ents {
				if !want[e.Name()] {
					h.errorf("unexpected entry %q (%v)", e.Name(), e.Type())
				}
				delete(want, e.Name())
			}
			for n := range want {
				h.errorf("missing entry %q", n)
			}
		}},
	}
	if _, err := os.Stat(root); errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s: the share has no posix/ directory", r.kind)
	}
	failed := 0
	for _, c := range checks {
		h := &hostCheck{root: root}
		c.fn(h)
		key := "host." + c.name
		if len(h.errs) == 0 {
			if _, ok := KnownFailures[key]; ok && r.kind == ourDaemon {
				t.Logf("known failure %s passes now: remove it from KnownFailures", key)
			}
			continue
		}
		if known(t, r.kind, key, strings.Join(h.errs, "; ")) {
			continue
		}
		if why, ok := rustHostDifferences[c.name]; ok && isRust(r.kind) {
			t.Logf("intended difference: host check %s fails with %s (%s): %s", c.name, r.kind, why, strings.Join(h.errs, "; "))
			continue
		}
		failed++
		t.Errorf("%s: host check %s:\n  %s", r.kind, c.name, strings.Join(h.errs, "\n  "))
	}
	t.Logf("%s: %d host checks, %d failed", r.kind, len(checks), failed)
}
