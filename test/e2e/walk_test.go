//go:build linux

package e2e

import (
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/bench"
)

// A big tree walked from the guest (issue 31): find, ls -lR and git status
// over tens of thousands of files, under --cache auto, where the guest's
// dentry cache keeps every inode it walked looked up and a daemon holding
// one fd per inode runs out of them.

const (
	// walkFilesPerDir: the host's tree is directories of this many empty
	// files (d0000/f0000 ...).
	walkFilesPerDir = 1000
	// walkSampleEvery: how often the host counts the daemon's fds.
	walkSampleEvery = 200 * time.Millisecond
)

// makeWalkTree creates files empty files under dir, walkFilesPerDir to a
// directory. The host makes it: under TCG the guest would take minutes.
func makeWalkTree(t *testing.T, dir string, files int) {
	t.Helper()
	for i := 0; i < files; i++ {
		sub := filepath.Join(dir, fmt.Sprintf("d%04d", i/walkFilesPerDir))
		if i%walkFilesPerDir == 0 {
			if err := os.MkdirAll(sub, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		fd, err := unix.Open(filepath.Join(sub, fmt.Sprintf("f%04d", i%walkFilesPerDir)), unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(fd)
	}
}

// mountTmpfs mounts a fresh tmpfs on a new temporary directory (unmounted
// at the end of the test).
func mountTmpfs(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "mode=0755"); err != nil {
		t.Fatalf("mount tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// walkShareTmpfs is a tmpfs holding the tree.
func walkShareTmpfs(t *testing.T, files int) string {
	t.Helper()
	dir := mountTmpfs(t)
	makeWalkTree(t, dir, files)
	return dir
}

// walkShareOverlay is an overlayfs holding the tree (mountWalkOverlay).
func walkShareOverlay(t *testing.T, files int) string {
	t.Helper()
	merged := t.TempDir()
	mountWalkOverlay(t, merged, files)
	return merged
}

// mountWalkOverlay mounts on mnt an overlayfs as container runtimes mount
// a container's root: lower, upper and work directories on a tmpfs of
// their own, the tree in the lower layer (the image), nfs_export off (its
// default), so name_to_handle_at answers EOPNOTSUPP and a daemon cannot
// hold its inodes as file handles.
func mountWalkOverlay(t *testing.T, mnt string, files int) {
	t.Helper()
	mountOverlay(t, mnt, func(lower string) { makeWalkTree(t, lower, files) })
}

// mountOverlay mounts on mnt an overlayfs as mountWalkOverlay does, with
// the lower layer (the image) made by fill before the mount.
func mountOverlay(t *testing.T, mnt string, fill func(lower string)) {
	t.Helper()
	base := mountTmpfs(t)
	for _, d := range []string{"lower", "upper", "work"} {
		if err := os.Mkdir(filepath.Join(base, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	fill(filepath.Join(base, "lower"))
	opts := fmt.Sprintf("lowerdir=%s/lower,upperdir=%s/upper,workdir=%s/work,nfs_export=off", base, base, base)
	if err := unix.Mount("overlay", mnt, "overlay", 0, opts); err != nil {
		t.Fatalf("mount overlay %s on %s: %v", opts, mnt, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
}

// ---------------------------------------------------------------------------
// The daemon's fds, sampled while the guest walks

// countFDs counts the entries of /proc/PID/fd without making a string per
// fd (a daemon may hold 100,000).
func countFDs(pid int) (int, error) {
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/fd", pid), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	buf := make([]byte, 64<<10)
	n := 0
	for {
		m, err := unix.Getdents(fd, buf)
		if err != nil {
			return 0, err
		}
		if m == 0 {
			return n - 2, nil // "." and ".."
		}
		// struct linux_dirent64: d_ino, d_off (8 bytes each), d_reclen.
		for off := 0; off < m; off += int(binary.NativeEndian.Uint16(buf[off+16:])) {
			n++
		}
	}
}

// daemonFDs is the most fds any process of the daemon's tree holds: the
// serving process (a sandboxed daemon's child; its supervisor holds a
// few). ok is false once no process of the tree is left to count.
func daemonFDs(root int) (most int, ok bool) {
	for _, pid := range bench.ProcessTree(root) {
		if n, err := countFDs(pid); err == nil {
			most, ok = max(most, n), true
		}
	}
	return most, ok
}

// fdSample is one count of the daemon's fds.
type fdSample struct {
	At    time.Duration // since sampling began
	Phase string        // what the guest was doing (the step it was in)
	FDs   int
}

// fdSampler counts a daemon's fds every walkSampleEvery until stopped.
type fdSampler struct {
	stop    chan struct{}
	done    chan struct{}
	mu      sync.Mutex
	samples []fdSample
}

// sampleFDs starts sampling the fds of the daemon whose process (group
// leader) is root; phase names what the guest is doing at each sample.
func sampleFDs(root int, phase func() string) *fdSampler {
	s := &fdSampler{stop: make(chan struct{}), done: make(chan struct{})}
	start := time.Now()
	go func() {
		defer close(s.done)
		tick := time.NewTicker(walkSampleEvery)
		defer tick.Stop()
		for {
			if n, ok := daemonFDs(root); ok {
				s.mu.Lock()
				s.samples = append(s.samples, fdSample{At: time.Since(start), Phase: phase(), FDs: n})
				s.mu.Unlock()
			}
			select {
			case <-s.stop:
				return
			case <-tick.C:
			}
		}
	}()
	return s
}

// Stop ends the sampling and returns the samples.
func (s *fdSampler) Stop() []fdSample {
	close(s.stop)
	<-s.done
	return s.samples
}

// fdStats is the most and the last of some samples.
type fdStats struct{ N, Max, Last int }

func summarizeFDs(samples []fdSample, phase string) fdStats {
	var st fdStats
	for _, s := range samples {
		if phase == "" || s.Phase == phase {
			st.N++
			st.Max = max(st.Max, s.FDs)
			st.Last = s.FDs
		}
	}
	return st
}

func (s fdStats) String() string {
	if s.N == 0 {
		return "no samples"
	}
	return fmt.Sprintf("max %d, last %d (%d samples)", s.Max, s.Last, s.N)
}

// currentStep is the step the guest is in: the last E2E-STEP-BEGIN whose
// E2E-STEP has not come ("" between steps).
func currentStep(lines []string) string {
	for i := len(lines) - 1; i >= 0; i-- {
		if reStep.MatchString(lines[i]) {
			return ""
		}
		if m := reBegin.FindStringSubmatch(lines[i]); m != nil {
			return m[1]
		}
	}
	return ""
}

// ---------------------------------------------------------------------------
// The guest's report (guest-scripts/walk-lib.sh)

var reWalk = regexp.MustCompile(`^E2E-WALK (\S+) files=(\d+) errors=(\d+) emfile=(\d+) estale=(\d+) cs=(\d+)$`)

// walkResult is one E2E-WALK line.
type walkResult struct {
	Op                            string
	Files, Errors, EMFILE, ESTALE int
	Took                          time.Duration
}

func parseWalk(lines []string) (walkResult, bool) {
	for _, l := range lines {
		if m := reWalk.FindStringSubmatch(l); m != nil {
			n := make([]int, 5)
			for i := range n {
				n[i], _ = strconv.Atoi(m[i+2])
			}
			return walkResult{Op: m[1], Files: n[0], Errors: n[1], EMFILE: n[2], ESTALE: n[3],
				Took: time.Duration(n[4]) * 10 * time.Millisecond}, true
		}
	}
	return walkResult{}, false
}

// walkWant is how many files a walk of a tree of files must report.
func walkWant(op string, files int) int {
	if op == "stat2" {
		return 2 * files
	}
	return files
}

// ---------------------------------------------------------------------------
// What the daemon under test offers

var (
	helpOnce sync.Once
	helpText string
	helpErr  error
)

// ourDaemonHelp is the daemon's --help (once per test binary).
func ourDaemonHelp(t *testing.T) string {
	t.Helper()
	bin := ourDaemonBinary(t)
	helpOnce.Do(func() {
		out, err := exec.Command(bin, "--help").CombinedOutput()
		helpText = string(out)
		if err != nil && !strings.Contains(helpText, "--shared-dir") {
			helpErr = fmt.Errorf("%s --help: %v\n%s", bin, err, out)
		}
	})
	if helpErr != nil {
		t.Fatal(helpErr)
	}
	return helpText
}

// reHandlesDefault finds --inode-file-handles' default in --help.
var reHandlesDefault = regexp.MustCompile(`--inode-file-handles[^\n]*\(default "(\w+)"\)`)

// handlesByDefault reports whether the daemon holds inodes as file handles
// by default (--inode-file-handles=prefer, issue 31); before that, tests
// that walk a big tmpfs say so explicitly (handleArgs).
func handlesByDefault(t *testing.T) bool {
	m := reHandlesDefault.FindStringSubmatch(ourDaemonHelp(t))
	return m != nil && m[1] != "never"
}

// hasFDBudget reports whether the daemon has --inode-fd-budget (issue
// 31): without it a share whose file system has no file handles costs one
// fd per inode the guest holds.
func hasFDBudget(t *testing.T) bool {
	return strings.Contains(ourDaemonHelp(t), "--inode-fd-budget")
}

// ---------------------------------------------------------------------------

// walkRun is TestGuestWalk's size: files in the tree, the daemon's
// RLIMIT_NOFILE.
type walkRun struct{ files, nofile int }

func walkSize() walkRun {
	if fullE2E() {
		return walkRun{files: 100_000, nofile: 8192}
	}
	return walkRun{files: 20_000, nofile: 4096}
}

// TestGuestWalk: a Linux 6.12 guest (QEMU 10) walks a share of 20,000
// empty files in directories of 1,000 (100,000 with GOVIRTIOFSD_E2E_FULL=1)
// with find, ls -lR and two stat passes over every file (git status), one
// after the other, so the guest's dentry cache keeps every inode looked up.
// Our daemon runs as users run it, --cache auto, with --rlimit-nofile 4096
// (8192): far fewer fds than inodes. Each walk must finish with exit status
// 0, no error on the guest's stderr (no EMFILE, ENFILE or ESTALE) and
// the exact count. The host counts the daemon's fds every 200 ms meanwhile
// and logs the most and the last, per walk. The two subtests run at once.
//
//   - tmpfs: handles hold the inodes (--inode-file-handles=prefer, the
//     default from issue 31; said explicitly to a daemon whose --help
//     gives never as the default).
//   - overlayfs: lower/upper/work on tmpfs, nfs_export off, as a container's
//     root: no file handles; it needs the fd budget (--inode-fd-budget) and
//     is skipped while the daemon's --help does not list it (with one fd
//     per inode it fails with EMFILE; GOVIRTIOFSD_E2E_WALK_ALL=1 runs it
//     anyway).
func TestGuestWalk(t *testing.T) {
	requireE2E(t)
	k := newestKernelAtLeast(t, 6, 12, "the walks run under QEMU 10, which runs Linux 6.12 guests only")
	size := walkSize()
	base := []string{"--cache", "auto", "--rlimit-nofile", strconv.Itoa(size.nofile), "--log-level", "info"}
	// The two guests walk at once: each walk is mostly one guest process
	// and one daemon thread, and make test has 2 minutes for both.
	t.Run("tmpfs", func(t *testing.T) {
		t.Parallel()
		extra := base
		if !handlesByDefault(t) {
			t.Logf("this daemon holds inodes as fds by default: asking for --inode-file-handles=prefer")
			extra = append(extra, "--inode-file-handles=prefer")
		}
		scenarioWalk(t, k, walkShareTmpfs(t, size.files), size, extra)
	})
	t.Run("overlayfs", func(t *testing.T) {
		t.Parallel()
		if !hasFDBudget(t) && os.Getenv("GOVIRTIOFSD_E2E_WALK_ALL") != "1" {
			t.Skipf("the daemon's --help has no --inode-fd-budget: without an fd budget an overlayfs share without nfs_export costs one fd per inode and this walk of %d files fails with EMFILE under --rlimit-nofile %d (GOVIRTIOFSD_E2E_WALK_ALL=1 runs it anyway)",
				size.files, size.nofile)
		}
		scenarioWalk(t, k, walkShareOverlay(t, size.files), size, base)
	})
}

// scenarioWalk boots a guest running walk.sh on shared (a tree of
// size.files) against our daemon with extra, samples its fds, and checks
// every walk.
func scenarioWalk(t *testing.T, k guestKernel, shared string, size walkRun, extra []string) {
	e := &env{t: t, kind: ourDaemon, kernel: k, dir: artifactDir(t), shared: shared, extra: extra}
	sockDir, err := os.MkdirTemp("", "e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	e.sock = filepath.Join(sockDir, "vhost.sock")
	e.d = startDaemon(t, ourDaemon, e.sock, shared, filepath.Join(e.dir, "daemon.log"), extra...)
	// Under TCG a FUSE round trip takes 0.3-1 ms and a file costs a few.
	timeout := 3*time.Minute + time.Duration(size.files)*6*time.Millisecond
	v := e.start(vmConfig{Script: "walk", QEMU: qemu10, Timeout: timeout})
	sampler := sampleFDs(e.d.Pid(), func() string { return currentStep(v.consoleLines()) })
	v.waitExit()
	samples := sampler.Stop()
	e.daemonExit(v, true)
	writeFDSamples(t, filepath.Join(e.dir, "fd-samples.csv"), samples)
	g := parseConsole(v.consoleLines())
	if m := g.step(t, 1, "mount"); m.RC != 0 {
		t.Fatalf("mount failed (rc=%d): %v", m.RC, m.Output)
	}
	durations := v.stepDurations()
	t.Logf("%d files, --rlimit-nofile %d; daemon fds over the run: %s", size.files, size.nofile, summarizeFDs(samples, ""))
	for _, op := range []string{"find", "ls", "stat2"} {
		name := "walk-" + op
		st := g.step(t, 1, name)
		res, ok := parseWalk(st.Output)
		t.Logf("  %-10s rc=%d %+v took %.1fs (guest %.1fs); daemon fds %s", name, st.RC, res,
			durations[name].Seconds(), res.Took.Seconds(), summarizeFDs(samples, name))
		switch want := walkWant(op, size.files); {
		case !ok:
			t.Errorf("%s: no E2E-WALK line (rc=%d): %v", name, st.RC, st.Output)
		case st.RC != 0 || res.Errors != 0 || res.Files != want:
			t.Errorf("%s: exit status %d, %d files (want %d), %d errors (%d EMFILE/ENFILE, %d ESTALE): %s",
				name, st.RC, res.Files, want, res.Errors, res.EMFILE, res.ESTALE, strings.Join(st.Output, " | "))
		}
	}
}

// writeFDSamples keeps the samples as CSV beside the logs.
func writeFDSamples(t *testing.T, path string, samples []fdSample) {
	var b strings.Builder
	b.WriteString("ms,phase,fds\n")
	for _, s := range samples {
		fmt.Fprintf(&b, "%d,%s,%d\n", s.At.Milliseconds(), s.Phase, s.FDs)
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Error(err)
	}
}
