//go:build linux

package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/bench"
)

// The soak (make soak): one guest runs guest-scripts/soak.sh for
// GOVIRTIOFSD_SOAK (e.g. 1h) against our daemon while the host samples the
// daemon's resources. See TestSoak.
const (
	soakJobs     = 2        // fio jobs (one file each)
	soakSeqSize  = 32 << 20 // per job, the 1 MiB jobs
	soakRandSize = 8 << 20  // per job, the 4 KiB jobs
	soakFiles    = 2000     // files per churn round
	// An iteration (one fio job and one churn round) takes 20-60 s under
	// TCG on a loaded host; a guest averaging more than this per iteration
	// has slowed to a crawl.
	soakMaxIterTime = 3 * time.Minute
	soakMinIters    = 6
	// Fewer samples than this in the second half cannot show a trend.
	soakMinFit = 3
	// No console line for this long: the guest or the daemon is stuck.
	soakStall = 5 * time.Minute
	// Boot, the iteration running at the deadline, unmount and power-off.
	soakMargin = 15 * time.Minute
)

// soakSample is one sample of the daemon; its fields are the CSV columns.
type soakSample struct {
	Kind  string        // "periodic" (every interval) or "idle" (between iterations)
	At    time.Duration // since QEMU started
	Iters int           // iterations the guest had finished
	Procs int           // the daemon's processes (itself and its descendants)
	// Summed over Procs, from /proc/PID/status (KiB) and /proc/PID/fd.
	RssAnon, VmRSS, RssShmem int64
	Threads, FDs             int64
	// From the metrics endpoint; -1 when the scrape failed.
	Goroutines, Inodes, Handles, Requests int64
}

var soakCSVHeader = "kind,t_s,iters,procs,rss_anon_kib,vm_rss_kib,rss_shmem_kib,threads,fds,goroutines,open_inodes,open_handles,fuse_requests"

func (s soakSample) csv() string {
	return fmt.Sprintf("%s,%.1f,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d", s.Kind, s.At.Seconds(), s.Iters, s.Procs,
		s.RssAnon, s.VmRSS, s.RssShmem, s.Threads, s.FDs, s.Goroutines, s.Inodes, s.Handles, s.Requests)
}

// soakMetric is one sampled quantity and how much it may grow.
//
// The verdict fits a least-squares line to the samples of the second half of
// the soak (the first half is warm-up: pools, caches and the Go heap reach
// their working size) and projects it over that half: the growth it gives
// must not exceed max(Frac x the half's mean, Floor). A bounded quantity
// has a flat fit whatever its noise; one that leaks a little per request
// or per file grows with the hours the soak runs.
//
// Counts (fds, threads, goroutines, inodes, handles) are judged on the idle
// samples only: the guest takes them between iterations, after deleting
// everything it made and dropping its caches, so they measure what the
// daemon retains. A periodic sample catches the guest holding up to
// soakFiles files, which says where in an iteration it was, not whether
// anything leaks. RssAnon (the daemon's own memory: heap, stacks, buffers)
// is judged on both. VmRSS and RssShmem are reported only: they include
// the guest memory the daemon has touched through its shared mapping,
// which grows up to the guest's RAM and is no leak.
type soakMetric struct {
	Name  string
	Unit  string
	Value func(soakSample) int64
	Scale float64 // shown value = Value / Scale
	Frac  float64
	Floor float64 // in Value's unit
	Judge map[string]bool
}

var (
	idleOnly = map[string]bool{"idle": true}
	both     = map[string]bool{"idle": true, "periodic": true}
)

var soakMetrics = []soakMetric{
	{Name: "rss_anon", Unit: "MiB", Value: func(s soakSample) int64 { return s.RssAnon }, Scale: 1024, Frac: 0.10, Floor: 4 << 10, Judge: both},
	{Name: "vm_rss", Unit: "MiB", Value: func(s soakSample) int64 { return s.VmRSS }, Scale: 1024},
	{Name: "rss_shmem", Unit: "MiB", Value: func(s soakSample) int64 { return s.RssShmem }, Scale: 1024},
	{Name: "fds", Value: func(s soakSample) int64 { return s.FDs }, Scale: 1, Frac: 0.10, Floor: 16, Judge: idleOnly},
	{Name: "threads", Value: func(s soakSample) int64 { return s.Threads }, Scale: 1, Frac: 0.10, Floor: 16, Judge: idleOnly},
	{Name: "goroutines", Value: func(s soakSample) int64 { return s.Goroutines }, Scale: 1, Frac: 0.10, Floor: 16, Judge: idleOnly},
	{Name: "open_inodes", Value: func(s soakSample) int64 { return s.Inodes }, Scale: 1, Frac: 0.10, Floor: 16, Judge: idleOnly},
	{Name: "open_handles", Value: func(s soakSample) int64 { return s.Handles }, Scale: 1, Frac: 0.10, Floor: 16, Judge: idleOnly},
}

// soakStat summarizes one metric over one kind of sample.
type soakStat struct {
	N              int     // samples in the soak phase
	Min, Mean, Max float64 // over the soak phase
	Fit            int     // samples in the second half (the fit)
	SlopePerHour   float64 // least squares over the second half
	Growth, Limit  float64 // slope projected over the second half; max(Frac x its mean, Floor)
	Judged, Failed bool
}

// analyzeSoak computes m over the samples of one kind taken in
// [from, to], fitting the second half. Samples with a negative value (a
// failed scrape) are left out.
func analyzeSoak(samples []soakSample, kind string, from, to time.Duration, m soakMetric) soakStat {
	var st soakStat
	var xs, ys []float64
	mid := from + (to-from)/2
	sum := 0.0
	for _, s := range samples {
		v := m.Value(s)
		if s.Kind != kind || s.At < from || s.At > to || v < 0 {
			continue
		}
		y := float64(v)
		if st.N == 0 || y < st.Min {
			st.Min = y
		}
		if st.N == 0 || y > st.Max {
			st.Max = y
		}
		sum += y
		st.N++
		if s.At >= mid {
			xs = append(xs, s.At.Hours())
			ys = append(ys, y)
		}
	}
	if st.N > 0 {
		st.Mean = sum / float64(st.N)
	}
	st.Fit = len(xs)
	st.Judged = m.Judge[kind]
	if len(xs) < soakMinFit {
		st.Failed = st.Judged // too few samples to judge is a failure to show boundedness
		return st
	}
	slope, mean := leastSquares(xs, ys)
	st.SlopePerHour = slope
	st.Growth = slope * (xs[len(xs)-1] - xs[0])
	st.Limit = math.Max(m.Frac*mean, m.Floor)
	st.Failed = st.Judged && st.Growth > st.Limit
	return st
}

// leastSquares returns the slope of the least-squares line through the
// points and the mean of ys.
func leastSquares(xs, ys []float64) (slope, meanY float64) {
	var mx, my float64
	for i := range xs {
		mx += xs[i]
		my += ys[i]
	}
	mx /= float64(len(xs))
	my /= float64(len(ys))
	var sxy, sxx float64
	for i := range xs {
		sxy += (xs[i] - mx) * (ys[i] - my)
		sxx += (xs[i] - mx) * (xs[i] - mx)
	}
	if sxx == 0 {
		return 0, my
	}
	return sxy / sxx, my
}

// soakTable renders the stats of every metric and kind; failed reports
// whether any judged one failed.
func soakTable(samples []soakSample, from, to time.Duration) (table string, failed []string) {
	var b strings.Builder
	fmt.Fprintf(&b, "%-8s %-17s %5s %10s %10s %10s %4s %12s %10s %10s  %s\n",
		"samples", "metric", "n", "min", "mean", "max", "fit", "slope/h", "growth", "limit", "verdict")
	for _, kind := range []string{"idle", "periodic"} {
		for _, m := range soakMetrics {
			st := analyzeSoak(samples, kind, from, to, m)
			name := m.Name
			if m.Unit != "" {
				name += " (" + m.Unit + ")"
			}
			f := func(v float64) string { return strconv.FormatFloat(v/m.Scale, 'f', 1, 64) }
			verdict := "-"
			switch {
			case st.Failed && st.Fit < soakMinFit:
				verdict = fmt.Sprintf("FAIL: %d sample(s) to fit", st.Fit)
				failed = append(failed, fmt.Sprintf("%s %s: %d sample(s) in the second half, want at least %d",
					kind, name, st.Fit, soakMinFit))
			case st.Failed:
				verdict = "FAIL: grows"
				failed = append(failed, fmt.Sprintf("%s %s grows by %s over the second half (%s per hour), limit %s",
					kind, name, f(st.Growth), f(st.SlopePerHour), f(st.Limit)))
			case st.Judged:
				verdict = "ok"
			}
			limit := "-"
			if st.Judged {
				limit = f(st.Limit)
			}
			fmt.Fprintf(&b, "%-8s %-17s %5d %10s %10s %10s %4d %12s %10s %10s  %s\n",
				kind, name, st.N, f(st.Min), f(st.Mean), f(st.Max), st.Fit, f(st.SlopePerHour), f(st.Growth), limit, verdict)
		}
	}
	return b.String(), failed
}

// ---------------------------------------------------------------------------
// Sampling the daemon

// sampleProcs adds up the memory, thread and fd counts of the given
// processes (one that has just exited is skipped).
func sampleProcs(s *soakSample, pids []int) {
	m := bench.ProcessMemory(pids)
	s.Procs += m.Procs
	s.RssAnon += int64(m.RssAnon)
	s.VmRSS += int64(m.VmRSS)
	s.RssShmem += int64(m.RssShmem)
	s.Threads += int64(m.Threads)
	for _, pid := range pids {
		if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
			s.FDs += int64(len(fds))
		}
	}
}

// metricsClient scrapes the daemon's --metrics-addr unix socket.
func metricsClient(sock string) *http.Client {
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}},
	}
}

// scrape fills the gauges of s from the metrics endpoint and returns the
// page.
func scrape(c *http.Client, s *soakSample) (string, error) {
	s.Goroutines, s.Inodes, s.Handles, s.Requests = -1, -1, -1, -1
	resp, err := c.Get("http://daemon/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("metrics: %s", resp.Status)
	}
	var requests int64
	for _, line := range strings.Split(string(body), "\n") {
		name, value, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		n, err := strconv.ParseInt(value, 10, 64)
		if err != nil {
			continue
		}
		switch {
		case name == "govirtiofsd_goroutines":
			s.Goroutines = n
		case name == "govirtiofsd_open_inodes":
			s.Inodes = n
		case name == "govirtiofsd_open_handles":
			s.Handles = n
		case strings.HasPrefix(name, "govirtiofsd_fuse_requests_total{"):
			requests += n
		}
	}
	if s.Goroutines < 0 || s.Inodes < 0 || s.Handles < 0 {
		return string(body), errors.New("metrics: govirtiofsd_goroutines, _open_inodes or _open_handles missing")
	}
	s.Requests = requests
	return string(body), nil
}

// ---------------------------------------------------------------------------
// The test

var (
	reSoakIter = regexp.MustCompile(`^E2E-SOAK iter=\d+ `)
	reSoakEnd  = regexp.MustCompile(`^E2E-SOAK-END iterations=(\d+) rc=(\d+)`)
	reSoakAsk  = regexp.MustCompile(`^E2E-ASK soak-idle-(\d+)$`)
)

// soakDuration reads GOVIRTIOFSD_SOAK; the soak is skipped without it.
func soakDuration(t *testing.T) time.Duration {
	t.Helper()
	s := os.Getenv("GOVIRTIOFSD_SOAK")
	if s == "" {
		t.Skip("set GOVIRTIOFSD_SOAK=DURATION (e.g. 1h) to run the soak (make soak)")
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < time.Minute {
		t.Fatalf("GOVIRTIOFSD_SOAK=%q: want a duration of at least 1m", s)
	}
	return d
}

func soakInterval(t *testing.T) time.Duration {
	t.Helper()
	s := os.Getenv("GOVIRTIOFSD_SOAK_INTERVAL")
	if s == "" {
		return 10 * time.Second
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 100*time.Millisecond {
		t.Fatalf("GOVIRTIOFSD_SOAK_INTERVAL=%q: want a duration of at least 100ms", s)
	}
	return d
}

// TestSoak (GOVIRTIOFSD_SOAK=DURATION; make soak) runs guest-scripts/soak.sh
// for DURATION on the newest guest kernel (two request queues if it has
// multiqueue virtio-fs) against our daemon as in production (--cache never,
// --log-level info, --metrics-addr on a unix socket): iterations of fio
// write + read-verify (crc32c, verify_fatal; 1 MiB and 4 KiB blocks, direct
// and buffered in turn) and of metadata churn (soakFiles files created,
// renamed, linked, listed, read back and removed, with their directories).
//
// The host samples the daemon's process tree (RssAnon, VmRSS, RssShmem,
// threads, open fds) and its metrics (goroutines, open inodes and handles,
// FUSE requests) every GOVIRTIOFSD_SOAK_INTERVAL (default 10s), and once
// per iteration while the guest waits, idle, for it. The samples go to
// soak-samples.csv and the summary table to soak-summary.txt in the test's
// log directory.
//
// It fails if any fio pass or churn round fails or moves less than it
// should, the daemon exits before QEMU (or not with status 0 after it), the
// guest stalls for soakStall or averages more than soakMaxIterTime per
// iteration (at least soakMinIters), or a judged metric grows over the
// second half of the run (see soakMetric).
func TestSoak(t *testing.T) {
	dur := soakDuration(t)
	requireRoot(t)
	interval := soakInterval(t)
	kernels := guestKernels(t)
	k := kernels[len(kernels)-1]
	queues := 1
	if kernelAtLeast(k.Version, 6, 11) {
		queues = 2
	}

	metricsDir, err := os.MkdirTemp("", "soak-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(metricsDir) })
	metricsSock := filepath.Join(metricsDir, "metrics.sock")
	e := newEnv(t, ourDaemon, k, "--cache", "never", "--log-level", "info", "--metrics-addr", "unix:"+metricsSock)
	client := metricsClient(metricsSock)

	csv, err := os.Create(filepath.Join(e.dir, "soak-samples.csv"))
	if err != nil {
		t.Fatal(err)
	}
	defer csv.Close()
	fmt.Fprintln(csv, soakCSVHeader)

	v := startVM(t, e.dir, vmConfig{
		Kernel: k, Sock: e.sock, Script: "soak", Timeout: dur + soakMargin,
		DeviceOpts: []string{"num-request-queues=" + strconv.Itoa(queues)},
		Append: []string{
			"e2e.soaksecs=" + strconv.Itoa(int(dur.Seconds())),
			"e2e.soakjobs=" + strconv.Itoa(soakJobs),
			"e2e.soakseqsize=" + strconv.Itoa(soakSeqSize>>10) + "k",
			"e2e.soakrandsize=" + strconv.Itoa(soakRandSize>>10) + "k",
			"e2e.soakfiles=" + strconv.Itoa(soakFiles),
			"e2e.asktimeout=300",
		},
	})
	t.Logf("soak: %v on %s, %d request queue(s), our daemon pid %d; samples every %v in %s",
		dur, k.Version, queues, e.d.Pid(), interval, filepath.Join(e.dir, "soak-samples.csv"))

	// Sample until QEMU exits: periodically, and whenever the guest asks.
	var (
		samples      []soakSample
		lastPage     string
		answered     int
		nextPeriodic = time.Now()
		seenLines    int
		lastProgress = time.Now()
	)
	take := func(kind string, iters int) {
		s := soakSample{Kind: kind, At: time.Since(v.started), Iters: iters}
		sampleProcs(&s, bench.ProcessTree(e.d.Pid())) // a sandboxed daemon is a supervisor and its child
		page, err := scrape(client, &s)
		if err != nil {
			t.Logf("%s sample at %v: %v", kind, s.At.Round(time.Second), err)
		} else {
			lastPage = page
		}
		samples = append(samples, s)
		fmt.Fprintln(csv, s.csv())
	}
	for v.Running() {
		if !e.d.Running() {
			// At the end the daemon sees the disconnect before QEMU is
			// reaped; otherwise it died under the guest.
			if v.Wait(daemonExitTimeout) {
				break
			}
			t.Fatalf("daemon exited (%v) while the guest was running\n%s", e.d.Err(), tail(e.d.LogPath, 30))
		}
		lines := v.consoleLines()
		iters := countMatches(lines, reSoakIter)
		if len(lines) != seenLines {
			seenLines, lastProgress = len(lines), time.Now()
		} else if time.Since(lastProgress) > soakStall {
			t.Fatalf("no console output for %v: guest or daemon stuck\n%s", soakStall, lastLines(lines, 25))
		}
		var asks []string
		for _, l := range lines {
			if m := reSoakAsk.FindStringSubmatch(l); m != nil {
				asks = append(asks, m[1])
			}
		}
		for ; answered < len(asks); answered++ {
			take("idle", iters)
			v.answer("sampled-" + asks[answered])
		}
		if time.Now().After(nextPeriodic) {
			take("periodic", iters)
			nextPeriodic = nextPeriodic.Add(interval)
		}
		time.Sleep(200 * time.Millisecond)
	}
	v.waitExit()
	e.daemonExit(v, true)
	if lastPage != "" {
		_ = os.WriteFile(filepath.Join(e.dir, "metrics-last.txt"), []byte(lastPage), 0o644)
	}
	for _, l := range warnLines(t, e.d) {
		t.Logf("  daemon: %s", l)
	}

	// The guest's side: every iteration's fio pass and churn round.
	g := parseConsole(v.consoleLines())
	if m := g.step(t, 1, "mount"); m.RC != 0 {
		t.Fatalf("mount -t virtiofs failed (rc=%d): %v", m.RC, m.Output)
	}
	lines := v.consoleLines()
	var (
		iters                   []map[string]string
		endLine                 []string
		fioPasses, fioFailed    int
		churnFailed             int
		writtenKiB, verifiedKiB int64
		files, unlinked         int64
	)
	for _, l := range lines {
		switch {
		case reSoakIter.MatchString(l):
			iters = append(iters, parseLogfmt(l))
		case reSoakEnd.MatchString(l):
			endLine = reSoakEnd.FindStringSubmatch(l)
		}
	}
	for _, st := range g.Steps {
		switch {
		case strings.HasPrefix(st.Name, "soak-fio-"):
			f, err := checkSoakFio(st)
			if err != nil {
				t.Errorf("%s: %v\n%s", st.Name, err, lastLines(st.Output, 20))
				fioFailed++
				continue
			}
			fioPasses++
			writtenKiB += f.WrittenKiB
			verifiedKiB += f.VerifiedKiB
		case strings.HasPrefix(st.Name, "soak-churn-"):
			if st.RC != 0 {
				t.Errorf("%s: rc=%d\n%s", st.Name, st.RC, lastLines(st.Output, 20))
				churnFailed++
			}
		}
	}
	for _, it := range iters {
		n := func(k string) int64 { v, _ := strconv.ParseInt(it[k], 10, 64); return v }
		if it["churn_rc"] != "0" {
			continue
		}
		if n("files") != soakFiles || n("renamed") != soakFiles || n("verified") != soakFiles {
			t.Errorf("soak iteration %s: churn counts %v, want %d files created, renamed and verified", it["iter"], it, soakFiles)
			churnFailed++
		}
		files += n("files")
		unlinked += n("unlinked")
	}

	// The window the verdict looks at: from the mount to the guest's end
	// marker (afterwards it unmounts and powers off).
	mounted := v.markerTimes(reMounted)
	ends := v.markerTimes(reSoakEnd)
	if len(mounted) == 0 || len(ends) == 0 || endLine == nil {
		t.Fatalf("guest did not mount or did not finish the soak (mounted at %v, end marker at %v)\n%s",
			mounted, ends, lastLines(lines, 25))
	}
	from, to := mounted[0], ends[0]
	idle, periodic, scrapeErrs := 0, 0, 0
	for _, s := range samples {
		if s.Kind == "idle" {
			idle++
		} else if s.At >= from && s.At <= to {
			periodic++
		}
		// A scrape after the soak may race with the daemon's exit.
		if s.Goroutines < 0 && (s.Kind == "idle" || s.At <= to) {
			scrapeErrs++
		}
	}
	table, grew := soakTable(samples, from, to)
	nIters, _ := strconv.Atoi(endLine[1])
	summary := fmt.Sprintf("soak %v on %s, %d request queue(s), daemon --cache never --log-level info\n"+
		"soak phase %v (mount to end marker); %d iterations (%.0f s each on average)\n"+
		"fio write + verify: %d passes, %d MiB written and %d MiB read back and verified (%d files per pass; 1 MiB blocks: %d MiB each, 4 KiB: %d MiB)\n"+
		"churn: %d files created, renamed, read back and removed (%d unlinks with the links and symlinks)\n"+
		"samples: %d periodic (every %v) in the soak phase, %d idle (one per iteration); %d failed metrics scrapes\n"+
		"slope: least squares over the second half of the soak phase, per hour; growth: the slope over that half;\n"+
		"limit: max(10%% of the half's mean, floor) for judged metrics\n%s",
		dur, k.Version, queues, (to - from).Round(time.Second), nIters, (to-from).Seconds()/math.Max(1, float64(nIters)),
		fioPasses, writtenKiB>>10, verifiedKiB>>10, soakJobs, soakSeqSize>>20, soakRandSize>>20,
		files, unlinked, periodic, interval, idle, scrapeErrs, table)
	_ = os.WriteFile(filepath.Join(e.dir, "soak-summary.txt"), []byte(summary), 0o644)
	t.Logf("\n%s", summary)

	// Verdicts.
	if rc := endLine[2]; rc != "0" || fioFailed > 0 || churnFailed > 0 {
		t.Fatalf("the guest's soak failed (rc=%s): %d fio pass(es) and %d churn round(s) failed", rc, fioFailed, churnFailed)
	}
	if nIters != len(iters) {
		t.Errorf("the guest reports %d iterations, the console holds %d iteration markers", nIters, len(iters))
	}
	minIters := max(soakMinIters, int(dur/soakMaxIterTime))
	if nIters < minIters {
		t.Errorf("%d iterations in %v, want at least %d (at most %v each on average)", nIters, dur, minIters, soakMaxIterTime)
	}
	if idle != nIters {
		t.Errorf("%d idle samples for %d iterations", idle, nIters)
	}
	if want := int((to - from) / interval); periodic < want/2 {
		t.Errorf("%d periodic samples in %v, want about %d: the sampler fell behind", periodic, to-from, want)
	}
	if scrapeErrs > 0 {
		t.Errorf("%d metrics scrapes failed", scrapeErrs)
	}
	for _, f := range grew {
		t.Errorf("unbounded growth: %s", f)
	}
}

// soakFio is one soak fio pass: rw=write or randwrite with verify, so fio
// writes every block and then reads it back and verifies it.
type soakFio struct {
	Job                     string // e.g. soak-seq-1m-direct
	WrittenKiB, VerifiedKiB int64
}

// checkSoakFio reads a soak-fio-N step: fio exited 0, reported no error,
// and wrote and verified every byte of its numjobs files.
func checkSoakFio(st guestStep) (soakFio, error) {
	var f soakFio
	if st.RC != 0 {
		return f, fmt.Errorf("fio rc=%d", st.RC)
	}
	for _, l := range st.Output {
		m := reFio.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		// parseFioTerse reads the write fields for a job named *-write,
		// the read fields otherwise: the verify pass is the read side.
		w, err := parseFioTerse(m[1]+"-write", m[2])
		if err != nil {
			return f, err
		}
		r, err := parseFioTerse(m[1], m[2])
		if err != nil {
			return f, err
		}
		if r.Error != 0 {
			return f, fmt.Errorf("fio error %d", r.Error)
		}
		f = soakFio{Job: m[1], WrittenKiB: w.KiB, VerifiedKiB: r.KiB}
		size := int64(soakRandSize)
		if strings.HasPrefix(f.Job, "soak-seq-") {
			size = soakSeqSize
		}
		if want := size * soakJobs >> 10; f.WrittenKiB != want || f.VerifiedKiB != want {
			return f, fmt.Errorf("%s wrote %d KiB and verified %d KiB, want %d each", f.Job, f.WrittenKiB, f.VerifiedKiB, want)
		}
		return f, nil
	}
	return f, errors.New("no E2E-FIO line")
}
