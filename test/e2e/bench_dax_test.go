//go:build linux

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
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

// daxBenchRow is one workload's figures per configuration.
type daxBenchRow struct {
	fio    map[string]fioResult
	cached map[string][2]int64 // KiB before, after
}

// TestBenchGuestDAX (make bench-guest; GOVIRTIOFSD_BENCH_WORKLOADS must be
// empty or match "dax"): guest-scripts/bench-dax.sh once per
// configuration (daxBenchConfigs; GOVIRTIOFSD_BENCH_DAX_CONFIGS names a
// subset, e.g. ours-dax,ours-auto): sequential and
// random reads of a host-cached file half the window's size with the
// guest's page-cache growth, 4 KiB random reads through mmap, a sequential
// write, and sequential reads of a file four times the window; one round.
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
	runtime := 5
	if n, err := strconv.Atoi(os.Getenv("GOVIRTIOFSD_BENCH_RUNTIME")); err == nil && n > 0 {
		runtime = n
	}
	const window = 64 << 20
	shared := t.TempDir()
	writeRandomFile(t, filepath.Join(shared, "half"), window/2)
	writeRandomFile(t, filepath.Join(shared, "big"), 4*window)
	rows := map[string]*daxBenchRow{}
	var order []string
	for _, c := range cfgs {
		t.Run(c.name, func(t *testing.T) {
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
						row = &daxBenchRow{fio: map[string]fioResult{}, cached: map[string][2]int64{}}
						rows[m[1]] = row
						order = append(order, m[1])
					}
					row.fio[c.name] = r
				}
				if m := reCached.FindStringSubmatch(l); m != nil && rows[m[1]] != nil {
					b, _ := strconv.ParseInt(m[2], 10, 64)
					a, _ := strconv.ParseInt(m[3], 10, 64)
					rows[m[1]].cached[c.name] = [2]int64{b, a}
				}
			}
			if c.mount == "always" {
				if !strings.Contains(strings.Join(lines, "\n"), "dax=always") {
					t.Errorf("%s: /proc/mounts shows no dax=always", c.name)
				}
			}
		})
	}
	var b strings.Builder
	fmt.Fprintf(&b, "| workload |")
	for _, c := range cfgs {
		fmt.Fprintf(&b, " %s |", c.name)
	}
	fmt.Fprintf(&b, "\n| --- |%s\n", strings.Repeat(" --- |", len(cfgs)))
	for _, name := range order {
		row := rows[name]
		fmt.Fprintf(&b, "| %s |", name)
		for _, c := range cfgs {
			r, ok := row.fio[c.name]
			if !ok {
				b.WriteString(" – |")
				continue
			}
			cell := fmt.Sprintf("%.0f MiB/s", float64(r.BWKiB)/1024)
			if strings.Contains(name, "rand") {
				cell = fmt.Sprintf("%.0f IOPS", r.IOPS)
			}
			if ca, ok := row.cached[c.name]; ok {
				cell += fmt.Sprintf(", Cached %+.1f MiB", float64(ca[1]-ca[0])/1024)
			}
			fmt.Fprintf(&b, " %s |", cell)
		}
		b.WriteString("\n")
	}
	// The page cache after reading half twice (seqread's before to
	// seqread2's after).
	if r1, r2 := rows["seqread-read"], rows["seqread2-read"]; r1 != nil && r2 != nil {
		fmt.Fprintf(&b, "| Cached growth, half (%d MiB) read twice |", window/2>>20)
		for _, c := range cfgs {
			a, ok1 := r1.cached[c.name]
			z, ok2 := r2.cached[c.name]
			if !ok1 || !ok2 {
				b.WriteString(" – |")
				continue
			}
			grow := float64(z[1]-a[0]) / 1024
			fmt.Fprintf(&b, " %.1f MiB (%.0f%%) |", grow, 100*grow/float64(window/2>>20))
		}
		b.WriteString("\n")
	}
	t.Logf("DAX bench (Linux %s, QEMU 11, window %d MiB, load %s):\n%s", k.Version, window>>20, hostLoad(), b.String())
	if dir := artifactDir(t); dir != "" {
		_ = os.WriteFile(filepath.Join(dir, "bench-dax.md"), []byte(b.String()), 0o644)
	}
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
