//go:build linux

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// daxBenchConfig is one column of TestBenchGuestDAX.
type daxBenchConfig struct {
	name    string
	kind    daemonKind
	extra   []string
	generic bool   // QEMU 11's generic device (with our window), else vhost-user-fs-pci
	mount   string // dax.sh's e2e.benchmount: always or none
}

// daxBenchConfigs: ours with a 64 MiB window under dax=always against ours,
// the Rust virtiofsd 1.14 and the C virtiofsd without DAX, all three at
// cache auto (the guest's page cache on), on the same Linux 7.x guest under
// QEMU 11.
var daxBenchConfigs = []daxBenchConfig{
	{name: "ours-dax", kind: ourDaemon, extra: []string{"--tag", "myfs", "--cache-size", daxWindow, "--cache", "auto", "--log-level", "info"}, generic: true, mount: "always"},
	{name: "ours-auto", kind: ourDaemon, extra: []string{"--cache", "auto", "--log-level", "info"}, mount: "none"},
	{name: "rust114-auto", kind: rust114Daemon, extra: []string{"--cache", "auto", "--thread-pool-size=0"}, mount: "none"},
	{name: "ref-auto", kind: refDaemon, extra: []string{"-o", "cache=auto", "--thread-pool-size=0"}, mount: "none"},
}

var reCached = regexp.MustCompile(`E2E-CACHED (\S+) (\d+) (\d+)`)

// daxBenchRow is one workload's figures per configuration, one per round.
type daxBenchRow struct {
	fio    map[string][]fioResult
	cached map[string][][2]int64 // KiB before, after
}

// figure is a workload's figure in a result: IOPS for the random ones,
// MiB/s for the others.
func (r fioResult) figure(workload string) float64 {
	if strings.Contains(workload, "rand") {
		return r.IOPS
	}
	return float64(r.BWKiB) / 1024
}

// medianRange is the median of xs (the mean of the middle two for an even
// count) and its extremes.
func medianRange(xs []float64) (med, lo, hi float64) {
	s := slices.Sorted(slices.Values(xs))
	n := len(s)
	if n == 0 {
		return 0, 0, 0
	}
	med = s[n/2]
	if n%2 == 0 {
		med = (s[n/2-1] + s[n/2]) / 2
	}
	return med, s[0], s[n-1]
}

// TestBenchGuestDAX (make bench-guest; GOVIRTIOFSD_BENCH_WORKLOADS must be
// empty or match "dax"): guest-scripts/bench-dax.sh once per
// configuration and round (daxBenchConfigs, taken in turn each round so a
// busy moment of the host hits all of them; GOVIRTIOFSD_BENCH_DAX_CONFIGS
// names a subset, e.g. ours-dax,ours-auto; GOVIRTIOFSD_BENCH_ROUNDS
// rounds, default 1): sequential and random reads of a host-cached file
// half the window's size with the guest's page-cache growth, 4 KiB random
// reads through mmap, a sequential write, and sequential reads of a file
// four times the window. It prints each figure as the median of the rounds
// with its range, and per round the ratio of ours-dax to the best of the
// others.
func TestBenchGuestDAX(t *testing.T) {
	if os.Getenv("GOVIRTIOFSD_E2E_BENCH") != "1" {
		t.Skip("set GOVIRTIOFSD_E2E_BENCH=1 to run the guest benchmark (make bench-guest)")
	}
	if s := os.Getenv("GOVIRTIOFSD_BENCH_WORKLOADS"); s != "" {
		if re, err := regexp.Compile(s); err != nil || !re.MatchString("dax") {
			t.Skipf("GOVIRTIOFSD_BENCH_WORKLOADS=%q does not match \"dax\"", s)
		}
	}
	requireRoot(t)
	peersBin(t, qemu11Wrapper)
	k := newestKernel7(t)
	cfgs := daxBenchConfigs
	if s := os.Getenv("GOVIRTIOFSD_BENCH_DAX_CONFIGS"); s != "" {
		var keep []daxBenchConfig
		for _, c := range cfgs {
			for _, n := range strings.Split(s, ",") {
				if n == c.name {
					keep = append(keep, c)
				}
			}
		}
		if len(keep) == 0 {
			t.Fatalf("GOVIRTIOFSD_BENCH_DAX_CONFIGS=%q names none of the DAX configurations", s)
		}
		cfgs = keep
	}
	runtime := benchCount(t, "GOVIRTIOFSD_BENCH_RUNTIME", 5)
	rounds := benchCount(t, "GOVIRTIOFSD_BENCH_ROUNDS", 1)
	const window = 64 << 20
	shared := t.TempDir()
	writeRandomFile(t, filepath.Join(shared, "half"), window/2)
	writeRandomFile(t, filepath.Join(shared, "big"), 4*window)
	rows := map[string]*daxBenchRow{}
	var order []string
	for round := range rounds {
		for _, c := range cfgs {
			t.Run(fmt.Sprintf("%s/round%d", c.name, round+1), func(t *testing.T) {
				daxBenchRun(t, c, k, shared, runtime, rows, &order)
			})
		}
	}
	b := daxBenchTable(cfgs, rows, order, window)
	t.Logf("DAX bench (Linux %s, QEMU 11, window %d MiB, %d rounds, load %s):\n%s", k.Version, window>>20, rounds, hostLoad(), b)
	if dir := artifactDir(t); dir != "" {
		_ = os.WriteFile(filepath.Join(dir, "bench-dax.md"), []byte(b), 0o644)
	}
}

// daxBenchRun boots the guest once for configuration c and adds its
// figures to rows (order: the workloads as first seen).
func daxBenchRun(t *testing.T, c daxBenchConfig, k guestKernel, shared string, runtime int, rows map[string]*daxBenchRow, order *[]string) {
	switch c.kind {
	case rust114Daemon:
		peersBin(t, rust114Name)
	case refDaemon:
		requireReference(t)
	}
	// Host-cached: read both files on the host first.
	for _, f := range []string{"half", "big"} {
		fileSHA(t, filepath.Join(shared, f))
	}
	e := newEnvAt(t, c.kind, k, shared, c.extra...)
	timeout := max(vmTimeout(), 5*time.Minute)
	v := e.start(vmConfig{QEMU: qemu11, Generic: c.generic, Script: "bench-dax", Timeout: timeout,
		Append: []string{"e2e.mount=0", "e2e.benchmount=" + c.mount, "e2e.benchruntime=" + strconv.Itoa(runtime)}})
	v.waitExit()
	e.daemonExit(v, false)
	lines := v.consoleLines()
	g := parseConsole(lines)
	for _, s := range g.Steps {
		if s.RC != 0 {
			t.Errorf("step %s rc=%d: %s", s.Name, s.RC, strings.Join(s.Output, " | "))
		}
	}
	for _, l := range lines {
		if m := reFio.FindStringSubmatch(l); m != nil {
			r, err := parseFioTerse(m[1], m[2])
			if err != nil {
				t.Error(err)
				continue
			}
			row := rows[m[1]]
			if row == nil {
				row = &daxBenchRow{fio: map[string][]fioResult{}, cached: map[string][][2]int64{}}
				rows[m[1]] = row
				*order = append(*order, m[1])
			}
			row.fio[c.name] = append(row.fio[c.name], r)
		}
		if m := reCached.FindStringSubmatch(l); m != nil && rows[m[1]] != nil {
			b, _ := strconv.ParseInt(m[2], 10, 64)
			a, _ := strconv.ParseInt(m[3], 10, 64)
			rows[m[1]].cached[c.name] = append(rows[m[1]].cached[c.name], [2]int64{b, a})
		}
	}
	if c.mount == "always" {
		if !strings.Contains(strings.Join(lines, "\n"), "dax=always") {
			t.Errorf("%s: /proc/mounts shows no dax=always", c.name)
		}
	}
}

// daxBenchTable renders rows: per workload and configuration the median
// figure of the rounds [min–max] and the median page-cache growth, the
// ratio of ours-dax to the best other configuration of the same round
// (median [min–max]), and the growth of the page cache over two reads of
// the half-window file.
func daxBenchTable(cfgs []daxBenchConfig, rows map[string]*daxBenchRow, order []string, window int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "| workload |")
	for _, c := range cfgs {
		fmt.Fprintf(&b, " %s |", c.name)
	}
	fmt.Fprintf(&b, " ours-dax / best other |\n| --- |%s --- |\n", strings.Repeat(" --- |", len(cfgs)))
	for _, name := range order {
		row := rows[name]
		unit := "MiB/s"
		if strings.Contains(name, "rand") {
			unit = "IOPS"
		}
		fmt.Fprintf(&b, "| %s |", name)
		for _, c := range cfgs {
			rs := row.fio[c.name]
			if len(rs) == 0 {
				b.WriteString(" – |")
				continue
			}
			var xs []float64
			for _, r := range rs {
				xs = append(xs, r.figure(name))
			}
			med, lo, hi := medianRange(xs)
			cell := fmt.Sprintf("%.0f %s", med, unit)
			if len(xs) > 1 {
				cell += fmt.Sprintf(" [%.0f–%.0f]", lo, hi)
			}
			if ca := row.cached[c.name]; len(ca) > 0 {
				var g []float64
				for _, x := range ca {
					g = append(g, float64(x[1]-x[0])/1024)
				}
				m, _, _ := medianRange(g)
				cell += fmt.Sprintf(", Cached %+.1f MiB", m)
			}
			fmt.Fprintf(&b, " %s |", cell)
		}
		// Round by round: ours-dax against the best of the others.
		var ratios []float64
		dax := row.fio["ours-dax"]
		for k := range dax {
			best := 0.0
			for _, c := range cfgs {
				if rs := row.fio[c.name]; c.name != "ours-dax" && k < len(rs) {
					best = max(best, rs[k].figure(name))
				}
			}
			if best > 0 {
				ratios = append(ratios, dax[k].figure(name)/best)
			}
		}
		if med, lo, hi := medianRange(ratios); len(ratios) > 0 {
			fmt.Fprintf(&b, " %.2f× [%.2f–%.2f] |\n", med, lo, hi)
		} else {
			b.WriteString(" – |\n")
		}
	}
	// The page cache after reading half twice (seqread's before to
	// seqread2's after), median of the rounds.
	if r1, r2 := rows["seqread-read"], rows["seqread2-read"]; r1 != nil && r2 != nil {
		fmt.Fprintf(&b, "| Cached growth, half (%d MiB) read twice |", window/2>>20)
		for _, c := range cfgs {
			a, z := r1.cached[c.name], r2.cached[c.name]
			var g []float64
			for k := range min(len(a), len(z)) {
				g = append(g, float64(z[k][1]-a[k][0])/1024)
			}
			if len(g) == 0 {
				b.WriteString(" – |")
				continue
			}
			med, lo, hi := medianRange(g)
			fmt.Fprintf(&b, " %.1f MiB (%.0f%%; %.0f–%.0f%%) |", med, 100*med/float64(window/2>>20),
				100*lo/float64(window/2>>20), 100*hi/float64(window/2>>20))
		}
		b.WriteString(" |\n")
	}
	return b.String()
}

// hostLoad is /proc/loadavg's first three figures.
func hostLoad() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// TestDAXBenchTable: medians with their range, and the ratio of ours-dax
// to the best other configuration of each round (no root).
func TestDAXBenchTable(t *testing.T) {
	cfgs := []daxBenchConfig{{name: "ours-dax"}, {name: "ours-auto"}, {name: "rust114-auto"}}
	iops := func(xs ...float64) []fioResult {
		var rs []fioResult
		for _, x := range xs {
			rs = append(rs, fioResult{IOPS: x})
		}
		return rs
	}
	rows := map[string]*daxBenchRow{
		"mmaprand-read": {fio: map[string][]fioResult{
			"ours-dax":     iops(300, 100, 200),
			"ours-auto":    iops(100, 50, 40),
			"rust114-auto": iops(150, 40, 100),
		}, cached: map[string][][2]int64{}},
	}
	got := daxBenchTable(cfgs, rows, []string{"mmaprand-read"}, 64<<20)
	// Rounds: 300/150, 100/50, 200/100: 2.00× each.
	want := "| mmaprand-read | 200 IOPS [100–300] | 50 IOPS [40–100] | 100 IOPS [40–150] | 2.00× [2.00–2.00] |"
	if !strings.Contains(got, want) {
		t.Fatalf("table:\n%s\nwant the row\n%s", got, want)
	}
	if m, lo, hi := medianRange([]float64{4, 1, 3, 2}); m != 2.5 || lo != 1 || hi != 4 {
		t.Fatalf("medianRange: %v %v %v", m, lo, hi)
	}
}
