//go:build linux

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// bench-guest's walk-* rows (issue 31): find, ls -lR and two lstat passes
// (git status) over a host-made tree of 100,000 empty files, on tmpfs and
// on an overlayfs without nfs_export, timed in the guest, with the
// daemon's fds sampled during each walk. They run on the configurations
// whose cache is auto: there the guest's dentry cache keeps what it walked
// looked up, and a daemon holding one fd per inode runs out; with cache
// none the guest lets go of each inode (FORGET) as soon as it is unused.

// walkBenchDefaultFiles is the size of the walk-* rows' trees
// (GOVIRTIOFSD_BENCH_WALK_FILES).
const walkBenchDefaultFiles = 100_000

// The walk trees in each share that runs walk rows: a directory of the
// share's tmpfs, and an overlayfs mounted on a directory of the share (a
// submount: every daemon serves it, ours and the Rust one announce it).
const (
	walkTmpfsDir   = "walk-tmpfs"
	walkOverlayDir = "walk-ovl"
)

// walkBenchConfigs are the configurations of the walk rows, each daemon
// with its defaults but for cache=auto (ours: its defaults): added to
// the default configurations when walk rows are selected.
var walkBenchConfigs = []string{"ours-auto", "ref-pool0-auto", "rust-pool0-auto", "rust114-pool0-auto"}

// walkBenchFiles reads GOVIRTIOFSD_BENCH_WALK_FILES (default 100,000).
func walkBenchFiles(t *testing.T) int {
	s := os.Getenv("GOVIRTIOFSD_BENCH_WALK_FILES")
	if s == "" {
		return walkBenchDefaultFiles
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("GOVIRTIOFSD_BENCH_WALK_FILES=%q: want a count", s)
	}
	return n
}

// walkBenchWorkloads: find, ls and stat2 on the tmpfs tree, then on the
// overlayfs one.
func walkBenchWorkloads(files int) []benchWorkload {
	var ws []benchWorkload
	for _, fs := range []struct{ name, dir string }{{"tmpfs", walkTmpfsDir}, {"ovl", walkOverlayDir}} {
		for _, op := range []string{"find", "ls", "stat2"} {
			ws = append(ws, benchWorkload{name: fmt.Sprintf("walk-%dk-%s-%s", files/1000, fs.name, op),
				rw: "walk", bs: op, depth: files, dir: fs.dir})
		}
	}
	return ws
}

// cacheAuto reports whether the configuration runs its daemon with cache
// auto: the walk rows run only there.
func (c benchConfig) cacheAuto() bool {
	for i, a := range c.extra {
		if a == "cache=auto" || a == "--cache=auto" || a == "auto" && i > 0 && c.extra[i-1] == "--cache" {
			return true
		}
	}
	return false
}

// runs reports whether the configuration runs workload w: a walk on a
// cache=auto configuration, anything else on a configuration not added
// for the walks alone.
func (c benchConfig) runs(w benchWorkload) bool {
	if w.rw == "walk" {
		return c.cacheAuto()
	}
	return !c.onlyWalk
}

// withWalkConfigs adds the walk configurations to the default ones when
// walk rows are selected: alone if only walk rows are, else marked
// onlyWalk, so that they do not run the fio rows too.
func withWalkConfigs(t *testing.T, cfgs, all []benchConfig, workloads []benchWorkload) []benchConfig {
	walks := 0
	for _, w := range workloads {
		if w.rw == "walk" {
			walks++
		}
	}
	if walks == 0 {
		return cfgs
	}
	onlyWalk := walks < len(workloads)
	if !onlyWalk {
		cfgs = nil
	}
	for _, name := range walkBenchConfigs {
		i := slices.IndexFunc(all, func(c benchConfig) bool { return c.name == name })
		if i < 0 {
			t.Fatalf("walk configuration %q missing", name)
		}
		c := all[i]
		c.onlyWalk = onlyWalk
		cfgs = append(cfgs, c)
	}
	return cfgs
}

// prepareWalkShare puts the walk trees into a configuration's share.
func prepareWalkShare(t *testing.T, share string, files int) {
	t.Helper()
	makeWalkTree(t, filepath.Join(share, walkTmpfsDir), files)
	mnt := filepath.Join(share, walkOverlayDir)
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	mountWalkOverlay(t, mnt, files)
}

// walkTimeout bounds one walk of files under TCG on a loaded host.
func walkTimeout(files int) time.Duration {
	return 2*time.Minute + time.Duration(files)*3*time.Millisecond
}

// runWalk runs walk workload w on r's guest with the daemon's fds sampled
// meanwhile, and records its sample: files per second, the most fds, the
// errors the guest saw (the larger of its stderr lines and the files
// missing from the count). A walk that
// failed counts its errors; only a missing result fails the test.
func (r *benchRun) runWalk(t *testing.T, w benchWorkload, ours []int) {
	from := len(r.v.consoleLines())
	cpu0 := sampleCPU(ours)
	sampler := sampleFDs(r.d.Pid(), func() string { return w.name })
	r.v.answer(w.spec())
	ok := r.next(walkTimeout(w.depth))
	fds := summarizeFDs(sampler.Stop(), "")
	if !ok {
		return
	}
	other := sampleCPU(ours).otherCores(cpu0)
	res, found := parseWalk(r.v.consoleLines()[from:])
	if !found {
		t.Errorf("%s: %s: no E2E-WALK line\n%s", r.cfg.name, w.name, lastLines(r.v.consoleLines()[from:], 10))
		return
	}
	// A file the guest could not reach is one line on its stderr, or
	// none (out of fds, the C and Rust daemons' guests listed fewer files
	// without an error line): count it once either way.
	errs := res.Errors
	if want := walkWant(w.bs, w.depth); res.Files != want {
		errs = max(errs, want-res.Files, 1)
	}
	took := max(res.Took, 10*time.Millisecond)
	r.res[w.name] = append(r.res[w.name], benchSample{val: float64(res.Files) / took.Seconds(), other: other,
		fds: fds.Max, errs: errs})
	if errs > 0 {
		t.Logf("%s: %s: %d files, %d errors (%d EMFILE/ENFILE, %d ESTALE)", r.cfg.name, w.name, res.Files, res.Errors, res.EMFILE, res.ESTALE)
	}
}

// walkFDTable lists, for the walk rows, each configuration's most fds
// during the walk and the errors its guest saw, the worst of the rounds.
func walkFDTable(b *strings.Builder, runs []*benchRun, workloads []benchWorkload) {
	if !slices.ContainsFunc(workloads, func(w benchWorkload) bool { return w.rw == "walk" }) {
		return
	}
	fmt.Fprintf(b, "\nWalks: the daemon's most fds during the walk (its serving process, sampled every %v) / the errors\n", walkSampleEvery)
	fmt.Fprintf(b, "the guest saw (the larger of its stderr lines and the files missing from the count), the worst of the rounds.\n\n%-24s", "workload")
	for _, r := range runs {
		fmt.Fprintf(b, " %16s", r.cfg.name)
	}
	b.WriteString("\n")
	for _, w := range workloads {
		if w.rw != "walk" {
			continue
		}
		fmt.Fprintf(b, "%-24s", w.name)
		for _, r := range runs {
			ss := r.res[w.name]
			if len(ss) == 0 {
				fmt.Fprintf(b, " %16s", "-")
				continue
			}
			fds, errs := 0, 0
			for _, s := range ss {
				fds, errs = max(fds, s.fds), max(errs, s.errs)
			}
			fmt.Fprintf(b, " %16s", fmt.Sprintf("%d / %d", fds, errs))
		}
		b.WriteString("\n")
	}
}

// TestWalkBenchPlan: which configurations run the walk rows, and what the
// guest is asked (no root).
func TestWalkBenchPlan(t *testing.T) {
	all := append(slices.Clone(benchConfigs), benchOptionalConfigs...)
	names := func(cs []benchConfig) string {
		var s []string
		for _, c := range cs {
			n := c.name
			if c.onlyWalk {
				n += "(walk)"
			}
			s = append(s, n)
		}
		return strings.Join(s, ",")
	}
	ws := benchWorkloads(2000)
	walks := walkBenchWorkloads(2000)
	if got := names(withWalkConfigs(t, benchConfigs, all, walks)); got != "ours-auto,ref-pool0-auto,rust-pool0-auto,rust114-pool0-auto" {
		t.Errorf("walk rows only: configurations %s", got)
	}
	mixed := withWalkConfigs(t, benchConfigs, all, ws)
	if got := names(mixed); got != "ours,ours-2q,ref-pool0,ref-pool2,rust-pool0,rust-pool2,ours-q11,rust114-q11,ours-auto(walk),ref-pool0-auto(walk),rust-pool0-auto(walk),rust114-pool0-auto(walk)" {
		t.Errorf("every row: configurations %s", got)
	}
	if got := withWalkConfigs(t, benchConfigs, all, ws[:3]); len(got) != len(benchConfigs) {
		t.Errorf("no walk rows: configurations %s", names(got))
	}
	fio, walk := ws[0], walks[5]
	for _, c := range mixed {
		if c.runs(walk) != c.cacheAuto() || c.runs(fio) == c.onlyWalk || c.cacheAuto() != strings.HasSuffix(c.name, "-auto") {
			t.Errorf("%s: runs walk %v, fio %v; cache auto %v", c.name, c.runs(walk), c.runs(fio), c.cacheAuto())
		}
	}
	if got := walk.spec(); got != "walk-2k-ovl-stat2 walk stat2 2000 walk-ovl" {
		t.Errorf("walk spec %q", got)
	}
	res, ok := parseWalk([]string{"x", "E2E-WALK stat2 files=3998 errors=2 emfile=1 estale=1 cs=1234"})
	if !ok || res != (walkResult{Op: "stat2", Files: 3998, Errors: 2, EMFILE: 1, ESTALE: 1, Took: 12340 * time.Millisecond}) {
		t.Errorf("parseWalk: %+v %v", res, ok)
	}
	if s := currentStep([]string{"E2E-STEP-BEGIN walk-find", "E2E-STEP walk-find rc=0", "E2E-STEP-BEGIN walk-ls", "ls: x"}); s != "walk-ls" {
		t.Errorf("currentStep %q", s)
	}
}
