// Command bench runs the side-by-side benchmark of govirtiofsd, the
// reference C virtiofsd and (with -rust) the Rust virtiofsd through the
// in-repo test front end (see package test/bench). It needs root (it mounts
// a tmpfs share; the other daemons' namespace sandboxes need it too).
//
//	go run ./test/bench/cmd -ours bin/govirtiofsd -rust .cache/peers/bin/virtiofsd-rust
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/bench"
)

func main() {
	o := bench.SuiteOptions{Out: os.Stdout, Progress: os.Stderr}
	flag.StringVar(&o.OursBin, "ours", "bin/govirtiofsd", "govirtiofsd binary")
	flag.StringVar(&o.RefBin, "ref", "/usr/lib/qemu/virtiofsd", "reference virtiofsd binary")
	flag.StringVar(&o.RustBin, "rust", "", "the Rust virtiofsd (e.g. .cache/peers/bin/virtiofsd-rust from make test-deps); without it the rust-* configurations are left out")
	flag.StringVar(&o.Share, "share", "", "share directory (default: a tmpfs mounted under the scratch dir)")
	flag.DurationVar(&o.Warmup, "warmup", 400*time.Millisecond, "warm-up per run")
	flag.DurationVar(&o.Duration, "duration", 1500*time.Millisecond, "measurement per run")
	flag.IntVar(&o.Depth, "depth", 16, "requests in flight")
	queueSize := flag.Uint("queue-size", 1024, "descriptors per ring")
	fileMiB := flag.Uint64("file-mib", 256, "size of each of the 4 data files")
	flag.IntVar(&o.Rounds, "rounds", 3, "rounds, configurations interleaved (the median is reported)")
	workloads := flag.String("workloads", "", "substrings selecting workloads, separated by | (default all)")
	configs := flag.String("configs", "", "comma-separated configuration names (default all: ours,ours-2q,ours-pool1,ours-pool0,ref-pool0,ref-pool2,ref-pool1,rust-pool0,rust-pool2)")
	flag.BoolVar(&o.RSS, "rss", true, "measure daemon memory")
	flag.BoolVar(&o.Ceiling, "ceiling", true, "measure the machine's ceiling for the 1 MiB workloads (the daemon's system calls alone)")
	flag.IntVar(&o.RSSDepth, "rss-depth", 64, "depth of the memory run")
	flag.DurationVar(&o.RSSTime, "rss-duration", 2*time.Second, "length of the memory run")
	flag.DurationVar(&o.Spin, "spin", 0, "poll the used ring this long before sleeping on the call eventfd")
	flag.IntVar(&o.IrqDiv, "irq-div", 0, "ask for an interrupt after inflight/N completions (0: after the next one, as Linux does)")
	flag.BoolVar(&o.Raw, "raw", false, "experimental: sleep on the call eventfd with a raw read(2) (no Go scheduler hand-off; a GC waits for the next completion)")
	flag.BoolVar(&o.Interleave, "interleave", false, "with several rings, send requests to every file from every ring (default: ring i carries files i, i+rings, ..., sequential or random, as Linux keeps a job on its CPU's queue)")
	cpuprofile := flag.String("cpuprofile", "", "write the front end's CPU profile here")
	flag.StringVar(&o.ProfileDir, "profile", "", "write a Go CPU profile of our daemon per run into this directory (CONFIG-WORKLOAD-N.pprof; our daemon then runs with --seccomp none)")
	flag.StringVar(&o.TraceDir, "trace", "", "write a Go execution trace of our daemon per run into this directory (CONFIG-WORKLOAD-N.trace, for go tool trace; our daemon then runs with --seccomp none)")
	oursEnv := flag.String("ours-env", "", "space-separated NAME=VALUE entries added to our daemon's environment (experiments)")
	packed := flag.Bool("packed", false, "also run ours on packed rings, as configurations \"packed\" and \"packed-2q\", and compare them with ours and ours-2q")
	alt := flag.String("alt", "", "another build of ours, run with default settings as configurations \"alt\" and \"alt-2q\" (A/B comparisons in one run)")
	builds := flag.String("builds", "", "more builds of ours, NAME=PATH,..., each run with default settings as configurations NAME and NAME-2q, as -alt (the same old build twice measures the spread an A/B run must beat; several builds bisect a change)")
	null := flag.Bool("null", false, "measure the front end alone against an in-process null device, then exit")
	scale := flag.Bool("scale", false, "run the scale benchmark instead (bench.RunScale): LOOKUP of every file of a large share, each kept, then OPEN of some; fds, memory per inode, lookups/s and errors per daemon")
	scaleFiles := flag.String("scale-files", "100000", "with -scale: share sizes in files, comma-separated (e.g. 15000,40000,100000,1000000; one directory per 1000 files)")
	scaleFS := flag.String("scale-fs", strings.Join(bench.ScaleFS, ","), "with -scale: file systems, comma-separated (tmpfs, ext4, overlay; dir: the scratch directory's own)")
	scaleOpens := flag.Int("scale-opens", 10000, "with -scale: files OPENed after the lookups")
	scaleConfigs := flag.String("scale-configs", "", "with -scale: configuration names, comma-separated (default all: ours,ours-never,ours-budget,ref,rust-1.13,rust-1.14; ours-budget once ours knows --inode-fd-budget)")
	scaleDepth := flag.Int("scale-depth", 1, "with -scale: LOOKUPs in flight (walkers sharing the directories)")
	rust14 := flag.String("rust14", "", "with -scale: the Rust virtiofsd 1.14 (.cache/peers/bin/virtiofsd-rust-1.14)")
	flag.Parse()
	o.QueueSize = uint16(*queueSize)
	o.OursEnv = strings.Fields(*oursEnv)
	o.FileSize = *fileMiB << 20

	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fatal(err)
		}
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	if *null {
		if err := bench.NullSuite(os.Stdout, o.Depth, o.QueueSize, o.Warmup, o.Duration); err != nil {
			fatal(err)
		}
		return
	}
	if *scale {
		runScale(o, *scaleDepth, *rust14, *scaleFiles, *scaleFS, *scaleConfigs, *scaleOpens, *builds)
		return
	}
	for _, w := range bench.DefaultWorkloads() {
		if *workloads == "" || matchAny(w.Name, *workloads) {
			o.Workloads = append(o.Workloads, w)
		}
	}
	for _, c := range bench.DefaultConfigs() {
		if c.Rust && o.RustBin == "" {
			if *configs != "" && contains(strings.Split(*configs, ","), c.Name) {
				fatal(fmt.Errorf("configuration %s needs -rust (make test-deps fetches the Rust virtiofsd)", c.Name))
			}
			continue
		}
		if *configs == "" || contains(strings.Split(*configs, ","), c.Name) {
			o.Configs = append(o.Configs, c)
		}
	}
	if *packed {
		o.Configs = append(o.Configs, bench.PackedConfigs()...)
	}
	others := strings.Split(*builds, ",")
	if *alt != "" {
		others = append([]string{"alt=" + *alt}, others...)
	}
	for _, b := range others {
		if b == "" {
			continue
		}
		name, path, ok := strings.Cut(b, "=")
		if !ok || name == "" || path == "" {
			fatal(fmt.Errorf("-builds %q: want NAME=PATH", b))
		}
		o.Configs = append(o.Configs, bench.Config{Name: name, Ours: true, Pool: -1, Rings: 1, Bin: path},
			bench.Config{Name: name + "-2q", Ours: true, Pool: -1, Rings: 2, Bin: path})
	}
	dir, err := os.MkdirTemp("", "govirtiofsd-bench-")
	if err != nil {
		fatal(err)
	}
	defer os.RemoveAll(dir)
	o.Dir = dir
	// On ^C: unmount the share and remove the scratch directory (the
	// daemons die with us: Pdeathsig).
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-sigs
		pprof.StopCPUProfile()
		unix.Unmount(filepath.Join(dir, "share"), unix.MNT_DETACH)
		os.RemoveAll(dir)
		os.Exit(1)
	}()
	start := time.Now()
	_, err = bench.RunSuite(o)
	fmt.Fprintf(os.Stderr, "total %v\n", time.Since(start).Round(time.Second))
	if err != nil {
		pprof.StopCPUProfile()
		os.RemoveAll(dir)
		fatal(err)
	}
}

// runScale runs bench.RunScale with the flags' settings: -builds adds
// other builds of ours, each with --inode-file-handles=prefer (an A/B run
// of memory per inode).
func runScale(o bench.SuiteOptions, depth int, rust14, files, fsList, configs string, opens int, builds string) {
	so := bench.ScaleOptions{FS: strings.Split(fsList, ","), Opens: opens, Rounds: o.Rounds, Depth: depth,
		Settle: 300 * time.Millisecond, Out: os.Stdout, Progress: os.Stderr}
	for _, f := range strings.Split(files, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			fatal(fmt.Errorf("-scale-files %q: want positive numbers", files))
		}
		so.Files = append(so.Files, n)
	}
	for _, c := range bench.ScaleConfigs(bench.ScaleBins{Ours: o.OursBin, Ref: o.RefBin, Rust: o.RustBin, Rust14: rust14}) {
		if configs == "" || contains(strings.Split(configs, ","), c.Name) {
			so.Configs = append(so.Configs, c)
		}
	}
	for _, b := range strings.Split(builds, ",") {
		if b == "" {
			continue
		}
		name, path, ok := strings.Cut(b, "=")
		if !ok || name == "" || path == "" {
			fatal(fmt.Errorf("-builds %q: want NAME=PATH", b))
		}
		so.Configs = append(so.Configs, bench.ScaleConfig{Config: bench.Config{Name: name, Ours: true, Pool: -1, Rings: 1,
			Bin: path, Extra: []string{"--inode-file-handles=prefer"}}})
	}
	dir, err := os.MkdirTemp("", "govirtiofsd-scale-")
	if err != nil {
		fatal(err)
	}
	so.Dir = dir
	start := time.Now()
	_, err = bench.RunScale(so)
	fmt.Fprintf(os.Stderr, "total %v\n", time.Since(start).Round(time.Second))
	os.RemoveAll(dir)
	if err != nil {
		fatal(err)
	}
}

func matchAny(name, list string) bool {
	for _, s := range strings.Split(list, "|") {
		if s != "" && strings.Contains(name, s) {
			return true
		}
	}
	return false
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(1)
}
