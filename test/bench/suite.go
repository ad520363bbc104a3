package bench

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// DefaultWorkloads is the side-by-side set.
func DefaultWorkloads() []Workload {
	return []Workload{
		{Name: "write 1M seq, 1 file", Kind: SeqWrite, Size: 1 << 20, Files: 1},
		{Name: "write 1M seq, 4 files", Kind: SeqWrite, Size: 1 << 20, Files: 4},
		{Name: "read 1M seq, 1 file", Kind: SeqRead, Size: 1 << 20, Files: 1},
		{Name: "read 1M seq, 4 files", Kind: SeqRead, Size: 1 << 20, Files: 4},
		{Name: "randwrite 4k, 4 files", Kind: RandWrite, Size: 4 << 10, Files: 4},
		{Name: "randread 4k, 4 files", Kind: RandRead, Size: 4 << 10, Files: 4},
		{Name: "create/getattr/release/unlink", Kind: Meta},
		{Name: "randread 4k, depth 1", Kind: RandRead, Size: 4 << 10, Files: 1, Depth: 1},
		{Name: "randwrite 4k, depth 1", Kind: RandWrite, Size: 4 << 10, Files: 1, Depth: 1},
		{Name: "metadata, depth 1", Kind: Meta, Depth: 1},
	}
}

// DefaultConfigs is the side-by-side set of daemon configurations. The
// first is ours by default; the reference's best is taken over
// RefCompared, the Rust virtiofsd's over RustCompared (its configurations
// run only with SuiteOptions.RustBin).
func DefaultConfigs() []Config {
	return []Config{
		{Name: "ours", Ours: true, Pool: -1, Rings: 1},
		{Name: "ours-2q", Ours: true, Pool: -1, Rings: 2},
		{Name: "ours-pool1", Ours: true, Pool: 1, Rings: 1},
		{Name: "ours-pool0", Ours: true, Pool: 0, Rings: 1},
		{Name: "ref-pool0", Pool: 0, Rings: 1},
		{Name: "ref-pool2", Pool: 2, Rings: 1},
		{Name: "ref-pool1", Pool: 1, Rings: 1},
		{Name: "rust-pool0", Rust: true, Pool: 0, Rings: 1},
		{Name: "rust-pool2", Rust: true, Pool: 2, Rings: 1},
	}
}

// RefCompared are the reference settings whose best is the bar.
var RefCompared = []string{"ref-pool0", "ref-pool2"}

// RustCompared are the Rust virtiofsd's settings whose best the "vs rust"
// column compares ours with (its default is --thread-pool-size 0).
var RustCompared = []string{"rust-pool0", "rust-pool2"}

// SuiteOptions configure a side-by-side run.
type SuiteOptions struct {
	OursBin   string
	RefBin    string
	RustBin   string // the Rust virtiofsd (make test-deps' wrapper)
	Dir       string // scratch directory (sockets, logs, the tmpfs share)
	Share     string // share directory; empty: a tmpfs mounted under Dir
	Warmup    time.Duration
	Duration  time.Duration
	Depth     int
	QueueSize uint16
	FileSize  uint64
	Rounds    int
	Workloads []Workload
	Configs   []Config
	RSS       bool
	RSSDepth  int
	RSSTime   time.Duration
	Spin      time.Duration
	IrqDiv    int
	Raw       bool
	// Interleave spreads each file's requests over every ring (see
	// RunSpec.Interleave).
	Interleave bool
	OursEnv    []string
	// Ceiling adds, per round, the machine's ceiling for each 1 MiB
	// workload (ceiling.go).
	Ceiling bool
	// ProfileDir, if set, gets a Go CPU profile of our daemon per run
	// (CONFIG-WORKLOAD-N.pprof, for go tool pprof). Our daemon then runs
	// with --seccomp none: the profiler's timers are outside the allowlist.
	ProfileDir string
	// TraceDir, if set, gets a Go execution trace of our daemon per run
	// (CONFIG-WORKLOAD-N.trace, for go tool trace), with --seccomp none.
	TraceDir string
	Out      io.Writer
	Progress io.Writer
	// Hook, if set, runs at the start and end of each measurement with
	// the daemon (e.g. to profile it).
	OnStart, OnStop func(d *Daemon, w Workload)
}

// Cell is one configuration's result on one workload.
type Cell struct {
	Res       *Result
	DaemonCPU time.Duration
	// Sched and FrontSched are the scheduler's account of the daemon's
	// threads and of this process's (the front end) over the
	// measurement.
	Sched, FrontSched Sched
	Err               error
}

// SuiteResult holds every figure.
type SuiteResult struct {
	Opts      SuiteOptions
	Cells     map[string]map[string][]Cell // workload -> config -> rounds
	Idle      map[string]Mem
	AfterLoad map[string]Mem
	LoadRate  map[string]float64
	Ceiling   map[string][]CeilingResult // workload -> rounds
	Errors    []error
}

const dataFiles = 4

func dataName(i int) string { return fmt.Sprintf("data%d", i) }

// prepareShare creates the share (a fresh tmpfs if possible) and the data
// files, and returns a cleanup function.
func prepareShare(o *SuiteOptions) (func(), error) {
	cleanup := func() {}
	if o.Share == "" {
		o.Share = filepath.Join(o.Dir, "share")
		if err := os.MkdirAll(o.Share, 0o755); err != nil {
			return nil, err
		}
		size := fmt.Sprintf("size=%d", dataFiles*o.FileSize+512<<20)
		if err := unix.Mount("tmpfs", o.Share, "tmpfs", 0, size+",mode=0755"); err == nil {
			share := o.Share
			cleanup = func() { unix.Unmount(share, unix.MNT_DETACH) }
		} else {
			// Not allowed to mount: use /dev/shm, a tmpfs too.
			dir, err2 := os.MkdirTemp("/dev/shm", "govirtiofsd-bench-")
			if err2 != nil {
				return nil, fmt.Errorf("mount tmpfs: %v; /dev/shm: %v", err, err2)
			}
			o.Share = dir
			cleanup = func() { os.RemoveAll(dir) }
		}
	}
	var st unix.Statfs_t
	if err := unix.Statfs(o.Share, &st); err == nil && st.Type != unix.TMPFS_MAGIC {
		fmt.Fprintf(o.Progress, "warning: share %s is not a tmpfs\n", o.Share)
	}
	chunk := make([]byte, 1<<20)
	for i := range chunk {
		chunk[i] = byte(i*13 + 1)
	}
	for i := range dataFiles {
		f, err := os.Create(filepath.Join(o.Share, dataName(i)))
		if err != nil {
			cleanup()
			return nil, err
		}
		for off := uint64(0); off < o.FileSize; off += uint64(len(chunk)) {
			if _, err := f.Write(chunk); err != nil {
				f.Close()
				cleanup()
				return nil, err
			}
		}
		f.Close()
	}
	return cleanup, nil
}

// cleanShare removes everything but the data files (files a failed
// metadata run left behind).
func cleanShare(share string) {
	ents, _ := os.ReadDir(share)
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "data") {
			os.RemoveAll(filepath.Join(share, e.Name()))
		}
	}
}

func (o *SuiteOptions) bin(c Config) string {
	if c.Bin != "" {
		return c.Bin
	}
	if c.Ours {
		return o.OursBin
	}
	if c.Rust {
		return o.RustBin
	}
	return o.RefBin
}

func (o *SuiteOptions) env(c Config) []string {
	if c.Ours {
		return o.OursEnv
	}
	return nil
}

// depth is w's number of requests in flight.
func (o *SuiteOptions) depth(w Workload) int {
	if w.Depth > 0 {
		return w.Depth
	}
	return o.Depth
}

func (o *SuiteOptions) files() []string {
	var f []string
	for i := range dataFiles {
		f = append(f, dataName(i))
	}
	return f
}

// bufMiB is the guest memory needed for depth requests of size bytes.
func bufMiB(depth, size int) uint64 {
	pages := uint64(depth) * uint64((size+4095)/4096+2)
	return max(64, (pages*4096*3/2)>>20+16)
}

// targetOptions are the front end's options for c: for the Rust virtiofsd,
// SET_VRING_ENABLE waits for the back end's ack as in QEMU >= 8.1 (the
// Rust daemon drops a kick that arrives before it has enabled the ring,
// and the front end's first kick, INIT's, would otherwise beat it).
func (c Config) targetOptions(queueSize uint16, bufMiB uint64) vmm.Options {
	opts := TargetOptions(c.Rings, queueSize, bufMiB)
	if c.Packed {
		opts.Features |= vmm.Bit(vmm.FRingPacked)
	}
	if c.Rust {
		opts.Ack = vmm.AckQEMU10
	}
	return opts
}

// runOne starts c's daemon, connects, runs w and stops the daemon.
func (o *SuiteOptions) runOne(c Config, w Workload, tag string) Cell {
	env := o.env(c)
	base := fmt.Sprintf("%s-%s-%s", c.Name, strings.NewReplacer(" ", "", ",", "-", "/", "-").Replace(w.Name), tag)
	if o.ProfileDir != "" && c.Ours {
		env = append(slices.Clip(env), "GOVIRTIOFSD_CPUPROFILE="+filepath.Join(o.ProfileDir, base+".pprof"))
	}
	if o.TraceDir != "" && c.Ours {
		env = append(slices.Clip(env), "GOVIRTIOFSD_TRACE="+filepath.Join(o.TraceDir, base+".trace"))
	}
	if (o.ProfileDir != "" || o.TraceDir != "") && c.Ours {
		c.Extra = append(slices.Clip(c.Extra), "--seccomp", "none")
	}
	d, err := StartDaemon(c, o.bin(c), o.Share, o.Dir, env)
	if err != nil {
		return Cell{Err: err}
	}
	defer d.Stop()
	size := max(w.Size, 4096)
	t, err := Connect(d.Sock, c.targetOptions(o.QueueSize, bufMiB(o.depth(w), size)), o.files(), o.FileSize)
	if err != nil {
		return Cell{Err: fmt.Errorf("%s: %w (log: %s)", c.Name, err, d.Tail(30))}
	}
	defer t.Close()
	var cpu0, cpu1 time.Duration
	var sched0, sched1, front0, front1 Sched
	self := []int{os.Getpid()}
	res, err := Run(t, RunSpec{Workload: w, Depth: o.depth(w), Warmup: o.Warmup, Duration: o.Duration,
		Prefix: tag, Spin: o.Spin, IrqDiv: o.IrqDiv, Raw: o.Raw, Interleave: o.Interleave, DebugPids: d.Pids,
		OnStart: func() {
			if o.OnStart != nil {
				o.OnStart(d, w)
			}
			cpu0 = d.CPU()
			sched0, front0 = ProcessSched(d.Pids()), ProcessSched(self)
		},
		OnStop: func() {
			cpu1 = d.CPU()
			sched1, front1 = ProcessSched(d.Pids()), ProcessSched(self)
			if o.OnStop != nil {
				o.OnStop(d, w)
			}
		}})
	if err != nil {
		return Cell{Err: fmt.Errorf("%s / %s: %w", c.Name, w.Name, err)}
	}
	res.OtherCPU -= cpu1 - cpu0
	if res.Withheld+res.Starved > 0 {
		fmt.Fprintf(o.Progress, "note: %s / %s: stalls of 0.5 s or more: %d with the notification withheld by the daemon, %d with the front end not scheduled\n",
			c.Name, w.Name, res.Withheld, res.Starved)
	}
	return Cell{Res: res, DaemonCPU: cpu1 - cpu0, Sched: sched1.Sub(sched0), FrontSched: front1.Sub(front0)}
}

// rssOne measures c's daemon idle after INIT and after a 1 MiB write run
// at RSSDepth.
func (o *SuiteOptions) rssOne(c Config) (idle, after Mem, rate float64, err error) {
	d, err := StartDaemon(c, o.bin(c), o.Share, o.Dir, o.env(c))
	if err != nil {
		return idle, after, 0, err
	}
	defer d.Stop()
	w := Workload{Name: "write 1M seq, 4 files", Kind: SeqWrite, Size: 1 << 20, Files: 4}
	t, err := Connect(d.Sock, c.targetOptions(o.QueueSize, bufMiB(o.RSSDepth, w.Size)), o.files(), o.FileSize)
	if err != nil {
		return idle, after, 0, err
	}
	defer t.Close()
	time.Sleep(300 * time.Millisecond)
	idle = d.Memory()
	res, err := Run(t, RunSpec{Workload: w, Depth: o.RSSDepth, Warmup: 200 * time.Millisecond, Duration: o.RSSTime,
		Spin: o.Spin, IrqDiv: o.IrqDiv, Raw: o.Raw})
	if err != nil {
		return idle, after, 0, err
	}
	time.Sleep(300 * time.Millisecond)
	after = d.Memory()
	return idle, after, res.Rate(w), nil
}

// RunSuite runs every workload on every configuration (configurations
// interleaved per workload, their order rotated each round, a fresh daemon
// per run), then the memory measurements, and prints the tables.
func RunSuite(o SuiteOptions) (*SuiteResult, error) {
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	cleanup, err := prepareShare(&o)
	if err != nil {
		return nil, err
	}
	defer cleanup()
	sr := &SuiteResult{Opts: o, Cells: map[string]map[string][]Cell{}, Idle: map[string]Mem{},
		AfterLoad: map[string]Mem{}, LoadRate: map[string]float64{}, Ceiling: map[string][]CeilingResult{}}
	n := 0
	for round := range o.Rounds {
		for _, w := range o.Workloads {
			if sr.Cells[w.Name] == nil {
				sr.Cells[w.Name] = map[string][]Cell{}
			}
			for k := range o.Configs {
				// Each round starts one configuration later: the
				// machine's slow phases and whatever ran just before
				// (the last workload's ceiling, another daemon's exit)
				// then fall on every configuration alike, not always
				// on the first.
				c := o.Configs[(k+round)%len(o.Configs)]
				if c.Rings > o.depth(w) {
					continue // a ring without requests measures nothing
				}
				n++
				cell := o.runOne(c, w, fmt.Sprintf("m%d", n))
				cleanShare(o.Share)
				sr.Cells[w.Name][c.Name] = append(sr.Cells[w.Name][c.Name], cell)
				if cell.Err != nil {
					sr.Errors = append(sr.Errors, cell.Err)
					fmt.Fprintf(o.Progress, "round %d  %-30s %-11s ERROR %v\n", round+1, w.Name, c.Name, cell.Err)
					continue
				}
				r := cell.Res
				el := r.Elapsed.Seconds()
				fmt.Fprintf(o.Progress, "round %d  %-30s %-11s %10.0f %-5s p50 %-9v p99 %-9v CPUs: daemon %.2f front %.2f others %.2f; per req: kicks %.3f sleeps %.3f spins %.3f\n",
					round+1, w.Name, c.Name, r.Rate(w), w.Unit(), r.Lat.quantile(0.5).Round(time.Microsecond),
					r.Lat.quantile(0.99).Round(time.Microsecond),
					cell.DaemonCPU.Seconds()/el, r.FrontCPU.Seconds()/el, r.OtherCPU.Seconds()/el,
					float64(r.Kicks)/float64(r.AllOps), float64(r.Sleeps)/float64(r.AllOps), float64(r.Spins)/float64(r.AllOps))
			}
			if o.Ceiling && HasCeiling(w) {
				c, err := Ceiling(o.Share, o.FileSize, w, o.depth(w), o.Duration)
				if err != nil {
					sr.Errors = append(sr.Errors, err)
					fmt.Fprintf(o.Progress, "round %d  %-30s %-11s ERROR %v\n", round+1, w.Name, "ceiling", err)
					continue
				}
				sr.Ceiling[w.Name] = append(sr.Ceiling[w.Name], c)
				fmt.Fprintf(o.Progress, "round %d  %-30s %-11s %10.0f MB/s with 1 thread, %.0f MB/s with %d\n",
					round+1, w.Name, "ceiling", c.One/1e6, c.All/1e6, c.CPUs)
			}
		}
	}
	if o.RSS {
		for _, c := range o.Configs {
			idle, after, rate, err := o.rssOne(c)
			if err != nil {
				sr.Errors = append(sr.Errors, fmt.Errorf("memory %s: %w", c.Name, err))
				fmt.Fprintf(o.Progress, "memory %-11s ERROR %v\n", c.Name, err)
				continue
			}
			sr.Idle[c.Name], sr.AfterLoad[c.Name], sr.LoadRate[c.Name] = idle, after, rate
			fmt.Fprintf(o.Progress, "memory %-11s idle RssAnon %d KiB, after depth-%d 1M writes (%.0f MB/s) %d KiB\n",
				c.Name, idle.RssAnon, o.RSSDepth, rate, after.RssAnon)
		}
	}
	sr.Print(o.Out)
	return sr, errors.Join(sr.Errors...)
}

// median returns the cell with the median rate among successful rounds.
func median(cells []Cell, w Workload) *Cell {
	var ok []*Cell
	for i := range cells {
		if cells[i].Err == nil {
			ok = append(ok, &cells[i])
		}
	}
	if len(ok) == 0 {
		return nil
	}
	sort.Slice(ok, func(a, b int) bool { return ok[a].Res.Rate(w) < ok[b].Res.Rate(w) })
	return ok[len(ok)/2]
}

// pairedRatio returns the median over rounds of name's rate divided by the
// best of refs' rates in the same round, counting only rounds in which name
// and at least one of refs succeeded. cells holds each configuration's
// rounds in order (RunSuite appends a failed round too).
// medianP99 is the median over rounds of the runs' p99 latency.
func medianP99(cells []Cell) (time.Duration, bool) {
	var p []time.Duration
	for _, c := range cells {
		if c.Err == nil {
			p = append(p, c.Res.Lat.quantile(0.99))
		}
	}
	if len(p) == 0 {
		return 0, false
	}
	slices.Sort(p)
	return p[len(p)/2], true
}

func pairedRatio(cells map[string][]Cell, w Workload, name string, refs []string) (float64, bool) {
	var ratios []float64
	for r, c := range cells[name] {
		if c.Err != nil {
			continue
		}
		best := 0.0
		for _, ref := range refs {
			if rc := cells[ref]; r < len(rc) && rc[r].Err == nil {
				best = max(best, rc[r].Res.Rate(w))
			}
		}
		if best > 0 {
			ratios = append(ratios, c.Res.Rate(w)/best)
		}
	}
	if len(ratios) == 0 {
		return 0, false
	}
	sort.Float64s(ratios)
	return ratios[len(ratios)/2], true
}

func fmtRate(v float64, unit string) string {
	switch unit {
	case "MB/s":
		return fmt.Sprintf("%.0f MB/s", v)
	default:
		return fmt.Sprintf("%.1fk %s", v/1000, unit)
	}
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= 10*time.Millisecond:
		return fmt.Sprintf("%.0fms", d.Seconds()*1e3)
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2fms", d.Seconds()*1e3)
	}
	return fmt.Sprintf("%.0fµs", d.Seconds()*1e6)
}

func ringFiles(interleave bool) string {
	if interleave {
		return "every ring sends requests to every file (-interleave)"
	}
	return "ring 1 carries files 0 and 2, ring 2 files 1 and 3 (as Linux keeps a job on its CPU's queue)"
}

// Print writes the tables.
func (sr *SuiteResult) Print(out io.Writer) {
	o := sr.Opts
	fmt.Fprintf(out, "\nDirect front end (test/vmm rings, indirect descriptors, one per 4 KiB page, EVENT_IDX), tmpfs share, cache=none,\n"+
		"depth %d in total (spread over the request rings), %v per run after %v warm-up, median of %d round(s); MB = 10^6 bytes.\n"+
		"ratio = ours (default settings) / best of %s; 2q = ours with 2 request rings / the same best;\n"+
		"paired = the median over rounds of ours / that round's best of the same (a slow phase of the machine\n"+
		"lasts seconds and falls on every configuration of a round alike, so it moves this figure less);\n"+
		"2q/1q = ours-2q / ours, of the medians and paired by round; vs rust = ours / best of %s.\n"+
		"With 2 rings, %s.\n\n",
		o.Depth, o.Duration, o.Warmup, o.Rounds, strings.Join(RefCompared, ", "), strings.Join(RustCompared, ", "), ringFiles(o.Interleave))
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	hdr := []string{"workload"}
	for _, c := range o.Configs {
		hdr = append(hdr, c.Name)
	}
	hdr = append(hdr, "ratio", "paired", "2q ratio", "vs ref-pool0", "2q/1q", "2q/1q paired", "vs rust")
	fmt.Fprintln(tw, strings.Join(hdr, "\t")+"\t")
	for _, w := range o.Workloads {
		row := []string{w.Name}
		rate := map[string]float64{}
		for _, c := range o.Configs {
			m := median(sr.Cells[w.Name][c.Name], w)
			if m == nil {
				row = append(row, missing(sr.Cells[w.Name][c.Name]))
				continue
			}
			rate[c.Name] = m.Res.Rate(w)
			row = append(row, fmtRate(rate[c.Name], w.Unit()))
		}
		best, bestRust := 0.0, 0.0
		for _, n := range RefCompared {
			best = max(best, rate[n])
		}
		for _, n := range RustCompared {
			bestRust = max(bestRust, rate[n])
		}
		ratio := func(n string, base float64) string {
			if v, ok := rate[n]; ok && base > 0 {
				return fmt.Sprintf("%.2fx", v/base)
			}
			return "-"
		}
		paired := func(n string, refs []string) string {
			if v, ok := pairedRatio(sr.Cells[w.Name], w, n, refs); ok {
				return fmt.Sprintf("%.2fx", v)
			}
			return "-"
		}
		row = append(row, ratio("ours", best), paired("ours", RefCompared), ratio("ours-2q", best), ratio("ours", rate["ref-pool0"]),
			ratio("ours-2q", rate["ours"]), paired("ours-2q", []string{"ours"}), ratio("ours", bestRust))
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()

	sr.printPairs(out)
	sr.printCeiling(out)

	fmt.Fprintf(out, "\nLatency p50 / p99 (submission to reap) of the run with the median rate; p99 ratio = the median over rounds\n"+
		"of ours' p99 / the lowest such median of %s\n\n", strings.Join(append(slices.Clone(RefCompared), RustCompared...), ", "))
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(hdr[:len(o.Configs)+1], "\t")+"\tp99 ratio\t")
	for _, w := range o.Workloads {
		row := sr.configRow(w, func(m *Cell) string {
			return fmtDur(m.Res.Lat.quantile(0.5)) + " / " + fmtDur(m.Res.Lat.quantile(0.99))
		})
		best := time.Duration(0)
		for _, n := range append(slices.Clone(RefCompared), RustCompared...) {
			if p, ok := medianP99(sr.Cells[w.Name][n]); ok && (best == 0 || p < best) {
				best = p
			}
		}
		if p, ok := medianP99(sr.Cells[w.Name]["ours"]); ok && best > 0 {
			row = append(row, fmt.Sprintf("%.2fx", float64(p)/float64(best)))
		} else {
			row = append(row, "-")
		}
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()

	fmt.Fprintf(out, "\nCPUs used during the measurement: daemon (all its processes) / front end (this process) / everything else\non the machine (other load; %d CPUs in all), then the front end's CPU µs per request\n\n", runtime.NumCPU())
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(hdr[:len(o.Configs)+1], "\t")+"\t")
	for _, w := range o.Workloads {
		row := sr.configRow(w, func(m *Cell) string {
			s := m.Res.Elapsed.Seconds()
			return fmt.Sprintf("%.2f / %.2f / %.2f  %.1fµs", m.DaemonCPU.Seconds()/s, m.Res.FrontCPU.Seconds()/s,
				m.Res.OtherCPU.Seconds()/s, m.Res.FrontCPU.Seconds()*1e6/float64(max(m.Res.Ops, 1)))
		})
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()

	fmt.Fprintf(out, "\nScheduling per request, daemon | front end: context switches voluntary+involuntary / CPU migrations /\n"+
		"run-queue wait (runnable, waiting for a CPU), from /proc/PID/task/*/sched and schedstat\n\n")
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(hdr[:len(o.Configs)+1], "\t")+"\t")
	for _, w := range o.Workloads {
		row := sr.configRow(w, func(m *Cell) string {
			return m.Sched.PerOp(int64(m.Res.Ops)) + " | " + m.FrontSched.PerOp(int64(m.Res.Ops))
		})
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()

	// CPU per request is the figure a busy machine disturbs least: a
	// daemon that is starved serves fewer requests but spends about the
	// same per request.
	fmt.Fprintf(out, "\nDaemon CPU µs per request (all its threads and processes); ratio = ours / the best of %s\n\n", strings.Join(RefCompared, ", "))
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(hdr[:len(o.Configs)+1], "\t")+"\tratio\t")
	for _, w := range o.Workloads {
		row := []string{w.Name}
		cost := map[string]float64{}
		for _, c := range o.Configs {
			m := median(sr.Cells[w.Name][c.Name], w)
			if m == nil {
				row = append(row, missing(sr.Cells[w.Name][c.Name]))
				continue
			}
			cost[c.Name] = m.DaemonCPU.Seconds() * 1e6 / float64(max(m.Res.Ops, 1))
			row = append(row, fmt.Sprintf("%.1fµs", cost[c.Name]))
		}
		best := 0.0
		for _, n := range RefCompared {
			if v, ok := cost[n]; ok && (best == 0 || v < best) {
				best = v
			}
		}
		if v, ok := cost["ours"]; ok && best > 0 {
			row = append(row, fmt.Sprintf("%.2fx", v/best))
		} else {
			row = append(row, "-")
		}
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()

	if len(sr.Idle) > 0 {
		fmt.Fprintf(out, "\nDaemon memory (KiB, summed over its processes): RssAnon idle after INIT, and after %v of 1 MiB writes\n"+
			"at depth %d on 4 files; RssShmem (guest pages touched through the shared mappings) for reference\n\n", o.RSSTime, o.RSSDepth)
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "daemon\tprocs\tthreads\tRssAnon idle\tRssAnon after\tRssShmem after\tMB/s at depth "+fmt.Sprint(o.RSSDepth)+"\t")
		names := slices.Collect(func(yield func(string) bool) {
			for _, c := range o.Configs {
				if !yield(c.Name) {
					return
				}
			}
		})
		for _, n := range names {
			i, ok := sr.Idle[n]
			if !ok {
				continue
			}
			a := sr.AfterLoad[n]
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%.0f\t\n", n, a.Procs, a.Threads, i.RssAnon, a.RssAnon, a.RssShmem, sr.LoadRate[n])
		}
		tw.Flush()
	}
	for _, e := range sr.Errors {
		fmt.Fprintf(out, "error: %v\n", e)
	}
}

// printCeiling writes each 1 MiB workload's ceiling (the round with the
// median best) and every configuration's share of it.
func (sr *SuiteResult) printCeiling(out io.Writer) {
	o := sr.Opts
	if len(sr.Ceiling) == 0 {
		return
	}
	cpus := 1
	for _, rounds := range sr.Ceiling {
		cpus = rounds[0].CPUs
	}
	fmt.Fprintf(out, "\nMachine ceiling: the same pwritev/preadv of 256 x 4 KiB segments (shuffled pages of %d buffers in a shared\n"+
		"mapping) on the same files from 1 thread and from %d, with no front end and no daemon; the round with the median\n"+
		"best. Then each configuration's rate as a share of the better of the two.\n\n", o.Depth, cpus)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	hdr := []string{"workload", "1 thread", fmt.Sprintf("%d threads", cpus)}
	for _, c := range o.Configs {
		hdr = append(hdr, c.Name)
	}
	fmt.Fprintln(tw, strings.Join(hdr, "\t")+"\t")
	for _, w := range o.Workloads {
		rounds := slices.Clone(sr.Ceiling[w.Name])
		if len(rounds) == 0 {
			continue
		}
		slices.SortFunc(rounds, func(a, b CeilingResult) int { return cmp.Compare(a.Best(), b.Best()) })
		c := rounds[len(rounds)/2]
		row := []string{w.Name, fmtRate(c.One/1e6, "MB/s"), fmtRate(c.All/1e6, "MB/s")}
		for _, cfg := range o.Configs {
			m := median(sr.Cells[w.Name][cfg.Name], w)
			if m == nil {
				row = append(row, "-")
				continue
			}
			row = append(row, fmt.Sprintf("%.2f", m.Res.Rate(w)*1e6/c.Best()))
		}
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()
}

// configRow is w's row of a per-configuration table: cell formats each
// configuration's run with the median rate.
func (sr *SuiteResult) configRow(w Workload, cell func(m *Cell) string) []string {
	row := []string{w.Name}
	for _, c := range sr.Opts.Configs {
		cells := sr.Cells[w.Name][c.Name]
		if m := median(cells, w); m != nil {
			row = append(row, cell(m))
		} else {
			row = append(row, missing(cells))
		}
	}
	return row
}

// missing is what a table shows for a configuration without a figure:
// "-" where it did not run (ours-2q at depth 1), "error" where it failed.
func missing(cells []Cell) string {
	if len(cells) == 0 {
		return "-"
	}
	return "error"
}

// PackedConfigs are ours on packed rings (bench -packed), compared with
// ours and ours-2q on split rings.
func PackedConfigs() []Config {
	return []Config{
		{Name: "packed", Ours: true, Pool: -1, Rings: 1, Packed: true},
		{Name: "packed-2q", Ours: true, Pool: -1, Rings: 2, Packed: true},
	}
}

// printPairs compares configurations two by two, for the pairs of which
// both ran: throughput (medians, and paired by round) and daemon CPU per
// request. An A/B run (-alt) reads the second table: ours / alt.
func (sr *SuiteResult) printPairs(out io.Writer) {
	sr.printPair(out, "Packed rings / split rings, ours with default settings",
		[][2]string{{"packed", "ours"}, {"packed-2q", "ours-2q"}})
	sr.printPair(out, "This build / the -alt build, default settings",
		[][2]string{{"ours", "alt"}, {"ours-2q", "alt-2q"}})
}

func (sr *SuiteResult) printPair(out io.Writer, title string, pairs [][2]string) {
	var have [][2]string
	for _, p := range pairs {
		if slices.ContainsFunc(sr.Opts.Configs, func(c Config) bool { return c.Name == p[0] }) &&
			slices.ContainsFunc(sr.Opts.Configs, func(c Config) bool { return c.Name == p[1] }) {
			have = append(have, p)
		}
	}
	if len(have) == 0 {
		return
	}
	fmt.Fprintf(out, "\n%s: throughput (medians; paired by round)\n"+
		"and daemon CPU µs per request (first, second, ratio)\n\n", title)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	hdr := []string{"workload"}
	for _, p := range have {
		hdr = append(hdr, p[0]+"/"+p[1], "paired", "CPU/req", "CPU ratio")
	}
	fmt.Fprintln(tw, strings.Join(hdr, "\t")+"\t")
	for _, w := range sr.Opts.Workloads {
		row := []string{w.Name}
		for _, p := range have {
			a, b := median(sr.Cells[w.Name][p[0]], w), median(sr.Cells[w.Name][p[1]], w)
			if a == nil || b == nil || b.Res.Rate(w) == 0 {
				row = append(row, "-", "-", "-", "-")
				continue
			}
			row = append(row, fmt.Sprintf("%.2fx", a.Res.Rate(w)/b.Res.Rate(w)))
			if v, ok := pairedRatio(sr.Cells[w.Name], w, p[0], []string{p[1]}); ok {
				row = append(row, fmt.Sprintf("%.2fx", v))
			} else {
				row = append(row, "-")
			}
			ca := a.DaemonCPU.Seconds() * 1e6 / float64(max(a.Res.Ops, 1))
			cb := b.DaemonCPU.Seconds() * 1e6 / float64(max(b.Res.Ops, 1))
			row = append(row, fmt.Sprintf("%.1f / %.1fµs", ca, cb), fmt.Sprintf("%.2fx", ca/cb))
		}
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()
}
