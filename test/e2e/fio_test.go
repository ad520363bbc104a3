//go:build linux

package e2e

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// fioResult is one fio pass (guest-scripts/fio.sh), from its terse v3 line.
type fioResult struct {
	Job       string // e.g. rand-4k-direct-write
	Error     int
	KiB       int64 // bytes moved / 1024 in the pass's direction
	BWKiB     int64 // KiB/s
	IOPS      float64
	RuntimeMS int64
	// Completion latency percentiles in µs (0 if fio printed none).
	P50us, P99us float64
}

var reFio = regexp.MustCompile(`E2E-FIO (\S+) (3;.*)$`)

// parseFioTerse reads a terse v3 line: field 5 is the error, 6-9 read
// (KiB, KiB/s, IOPS, ms), 18-37 the read completion latency percentiles
// ("99.000000%=123", µs), and from 47 on the same for writes (1-based).
func parseFioTerse(job, line string) (fioResult, error) {
	f := strings.Split(line, ";")
	if len(f) < 50 {
		return fioResult{}, fmt.Errorf("%s: terse line has %d fields", job, len(f))
	}
	base := 5 // read: fields 6.. (0-based 5..)
	if strings.HasSuffix(job, "-write") {
		base = 46
	}
	r := fioResult{Job: job}
	var err error
	if r.Error, err = strconv.Atoi(f[4]); err != nil {
		return r, fmt.Errorf("%s: error field %q", job, f[4])
	}
	r.KiB, _ = strconv.ParseInt(f[base], 10, 64)
	r.BWKiB, _ = strconv.ParseInt(f[base+1], 10, 64)
	r.IOPS, _ = strconv.ParseFloat(f[base+2], 64)
	r.RuntimeMS, _ = strconv.ParseInt(f[base+3], 10, 64)
	for _, p := range f[base+12 : base+32] {
		pct, us, ok := strings.Cut(p, "%=")
		v, err := strconv.ParseFloat(us, 64)
		if !ok || err != nil {
			continue
		}
		switch pct {
		case "50.000000":
			r.P50us = v
		case "99.000000":
			r.P99us = v
		}
	}
	return r, nil
}

func fioJobs(matrix string) (jobs []string, size map[string]int64) {
	size = map[string]int64{}
	if matrix == "full" {
		for _, rw := range []string{"seq", "rand"} {
			for _, bs := range []string{"4k", "1m"} {
				for _, mode := range []string{"direct", "buffered"} {
					j := rw + "-" + bs + "-" + mode
					jobs = append(jobs, j)
					size[j] = 64 << 20
					if bs == "4k" {
						size[j] = 16 << 20
					}
				}
			}
		}
		return jobs, size
	}
	jobs = []string{"seq-1m-direct", "rand-4k-direct"}
	size["seq-1m-direct"], size["rand-4k-direct"] = 32<<20, 8<<20
	return jobs, size
}

func runFio(t *testing.T, kind daemonKind, k guestKernel, matrix string) map[string]fioResult {
	t.Helper()
	// Both daemons as they would run in production (ours without the
	// per-request debug log), no cache.
	var extra []string
	if kind == ourDaemon {
		extra = []string{"--cache", "never", "--log-level", "info"}
	}
	e := newEnv(t, kind, k, extra...)
	timeout := 3 * time.Minute
	if matrix == "full" {
		timeout = 8 * time.Minute
	}
	v := e.start(vmConfig{Script: "fio", Timeout: timeout,
		Append: []string{"e2e.fiomatrix=" + matrix}})
	v.waitExit()
	e.daemonExit(v, true)
	g := parseConsole(v.consoleLines())
	t.Logf("%s on %s: QEMU ran %.1fs; logs in %s", kind, k.Version, v.ExitTime().Sub(v.started).Seconds(), e.dir)
	res := map[string]fioResult{}
	for _, l := range v.consoleLines() {
		if m := reFio.FindStringSubmatch(l); m != nil {
			r, err := parseFioTerse(m[1], m[2])
			if err != nil {
				t.Errorf("%s: %v", kind, err)
				continue
			}
			res[m[1]] = r
		}
	}
	jobs, size := fioJobs(matrix)
	jobs = append(jobs, "perf-seq-1m") // without verify (fio.sh)
	size["perf-seq-1m"] = 256 << 20
	for _, j := range jobs {
		for _, pass := range []string{"write", "read"} {
			name := j + "-" + pass
			var st *guestStep
			for i := range g.Steps {
				if g.Steps[i].Name == "fio-"+name {
					st = &g.Steps[i]
				}
			}
			r, ok := res[name]
			switch {
			case st == nil:
				t.Errorf("%s: fio pass %s did not run", kind, name)
			case st.RC != 0 || !ok || r.Error != 0:
				t.Errorf("%s: fio pass %s failed: rc=%d error=%d\n%s", kind, name, st.RC, r.Error, lastLines(st.Output, 20))
			case r.KiB*1024 != size[j]:
				t.Errorf("%s: fio pass %s moved %d KiB, want %d", kind, name, r.KiB, size[j]>>10)
			}
		}
	}
	return res
}

// TestFioVerify runs fio write + read-verify passes (verify=crc32c) against
// the reference C daemon and ours and logs bandwidth, IOPS and the ratio
// ours/reference (no speed assertion). Default: a small matrix on Linux 6.1;
// GOVIRTIOFSD_E2E_FULL=1: {seq, rand} x {4k, 1m} x {direct, buffered}
// (64 MiB per 1m job, 16 MiB per 4k job) on every kernel.
func TestFioVerify(t *testing.T) {
	requireE2E(t)
	requireReference(t)
	matrix := "small"
	if fullE2E() {
		matrix = "full"
	}
	for _, k := range sideBySideKernels(t) {
		t.Run(k.Version, func(t *testing.T) {
			res := map[daemonKind]map[string]fioResult{}
			for _, kind := range []daemonKind{refDaemon, ourDaemon} {
				t.Run(kind.String(), func(t *testing.T) { res[kind] = runFio(t, kind, k, matrix) })
			}
			var names []string
			for n := range res[ourDaemon] {
				names = append(names, n)
			}
			sort.Strings(names)
			t.Logf("fio on %s (%s matrix, cache=none, psync, one job; perf-* without verify): MiB/s and IOPS, ours vs reference", k.Version, matrix)
			for _, n := range names {
				o, r := res[ourDaemon][n], res[refDaemon][n]
				t.Logf("  %-26s ours %8.1f MiB/s %8.0f IOPS   reference %8.1f MiB/s %8.0f IOPS   ratio %s",
					n, float64(o.BWKiB)/1024, o.IOPS, float64(r.BWKiB)/1024, r.IOPS, ratio(float64(o.BWKiB), float64(r.BWKiB)))
			}
		})
	}
}
