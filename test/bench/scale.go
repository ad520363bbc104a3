package bench

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// The scale run (make bench-scale, bench -scale): how each daemon holds a
// large tree the guest keeps looked up, as a guest's dentry cache does
// under --cache auto after a find or a git status. For each file system
// and share size a fresh share holds N empty files; each daemon in turn
// serves it, and the front end LOOKUPs every directory and file once,
// sending no FORGET, then OPENs the first Opens files and keeps them open.
// Per run it reports the descriptors the daemon's processes hold after
// mount, after the lookups and after the opens; its anonymous memory per
// inode; the host's slab growth per inode; LOOKUPs per second (one request
// in flight, as a single-threaded walk sends them); and the errors, by
// errno: a daemon that runs out of descriptors answers EMFILE or ENFILE,
// which the table shows rather than stopping the run.

// ScaleConfig is a daemon configuration of the scale run.
type ScaleConfig struct {
	Config
	// Needs is a command-line option the binary must know (its --help
	// mentions it) for the configuration to run: options that land later
	// (--inode-fd-budget) make their rows appear once the daemon has them.
	Needs string
}

// ScaleBins are the daemons' binaries; an empty one leaves its rows out.
type ScaleBins struct{ Ours, Ref, Rust, Rust14 string }

// ScaleConfigs are the daemons of the scale run, each with its defaults
// but for the cache mode (never, as the side-by-side run), plus ours with
// one O_PATH fd per inode (--inode-file-handles=never, under its default
// fd budget) and with a small fd budget (which bounds the inodes held by
// fd where the file system gives no handles).
func ScaleConfigs(b ScaleBins) []ScaleConfig {
	all := []struct {
		bin string
		c   ScaleConfig
	}{
		{b.Ours, ScaleConfig{Config: Config{Name: "ours", Ours: true}}},
		{b.Ours, ScaleConfig{Config: Config{Name: "ours-never", Ours: true, Extra: []string{"--inode-file-handles=never"}}}},
		{b.Ours, ScaleConfig{Config: Config{Name: "ours-budget", Ours: true, Extra: []string{"--inode-fd-budget=1024"}}, Needs: "--inode-fd-budget"}},
		{b.Ref, ScaleConfig{Config: Config{Name: "ref"}}},
		{b.Rust, ScaleConfig{Config: Config{Name: "rust-1.13", Rust: true}}},
		{b.Rust14, ScaleConfig{Config: Config{Name: "rust-1.14", Rust: true}}},
	}
	var out []ScaleConfig
	for _, e := range all {
		if e.bin == "" {
			continue
		}
		e.c.Bin, e.c.Pool, e.c.Rings = e.bin, -1, 1
		out = append(out, e.c)
	}
	return out
}

// Usable reports whether c's binary knows c.Needs.
func (c ScaleConfig) Usable() bool {
	if c.Needs == "" {
		return true
	}
	out, _ := exec.Command(c.Bin, "--help").CombinedOutput()
	return strings.Contains(string(out), c.Needs)
}

// ScaleOptions configure a scale run.
type ScaleOptions struct {
	Configs []ScaleConfig
	FS      []string // file systems (ScaleFS, or "dir")
	Files   []int    // share sizes, in files
	Opens   int      // files OPENed after the lookups
	Rounds  int      // daemons interleaved, each round one later
	// Depth is the number of walkers, each with one LOOKUP in flight (1:
	// a single-threaded find; more: the daemon's cost per LOOKUP rather
	// than the round trip).
	Depth  int
	Dir    string // scratch directory
	Settle time.Duration
	Out    io.Writer
	// Progress gets a line per run; nil discards it.
	Progress io.Writer
}

// ScaleRun is one daemon's run over one share.
type ScaleRun struct {
	Config, FS   string
	Files, Dirs  int
	Nofile       uint64 // the serving process's soft RLIMIT_NOFILE
	FDs          [3]int // held by the daemon's processes after mount, lookups, opens
	Mem          [2]int // KiB: RssAnon plus the daemon's own shared memory, after mount and after the lookups
	Slab         [2]int // KiB: the host's Slab (/proc/meminfo), same moments
	Lookups      int    // LOOKUPs sent
	Found        int    // answered with an entry
	LookupTime   time.Duration
	LookupCPU    time.Duration // the daemon's user+system time over the LOOKUPs
	LookupErrors map[syscall.Errno]int
	Opened       int
	OpenErrors   map[syscall.Errno]int
	Err          error // the run stopped (the daemon died or did not answer)
}

// BytesPerInode is the growth of RssAnon plus own shared memory from mount
// to after the lookups, per inode the daemon answered for.
func (r *ScaleRun) BytesPerInode() float64 {
	return float64(r.Mem[1]-r.Mem[0]) * 1024 / float64(max(r.Found, 1))
}

// SlabPerInode is the host's slab growth per inode looked up (the whole
// machine's: other processes add noise).
func (r *ScaleRun) SlabPerInode() float64 {
	return float64(r.Slab[1]-r.Slab[0]) * 1024 / float64(max(r.Found, 1))
}

// LookupRate is LOOKUPs answered (entry or error) per second.
func (r *ScaleRun) LookupRate() float64 { return float64(r.Lookups) / r.LookupTime.Seconds() }

// LookupCost is the daemon's CPU time per LOOKUP in microseconds: on a
// shared machine a steadier figure than the rate, which other load and
// the front end's own round trip also set.
func (r *ScaleRun) LookupCost() float64 {
	return r.LookupCPU.Seconds() * 1e6 / float64(max(r.Lookups, 1))
}

// RunScale runs every configuration on every file system and share size,
// prints a table per share and returns the runs.
func RunScale(o ScaleOptions) ([]ScaleRun, error) {
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	if o.Rounds < 1 {
		o.Rounds = 1
	}
	var configs []ScaleConfig
	for _, c := range o.Configs {
		if c.Usable() {
			configs = append(configs, c)
		} else {
			fmt.Fprintf(o.Out, "scale: %s left out: %s does not know %s\n", c.Name, c.Bin, c.Needs)
		}
	}
	var runs []ScaleRun
	var errs []error
	for _, fsType := range o.FS {
		for _, n := range o.Files {
			t0 := time.Now()
			share, err := prepareScaleShare(fsType, o.Dir, n)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s, %d files: %w", fsType, n, err))
				continue
			}
			fmt.Fprintf(o.Progress, "scale: %s share of %d files in %d directories ready in %v\n",
				fsType, share.Files, share.Dirs, time.Since(t0).Round(time.Millisecond))
			var these []ScaleRun
			for round := range o.Rounds {
				for k := range configs {
					c := configs[(k+round)%len(configs)]
					r := o.runScale(c, share)
					if r.Err != nil {
						errs = append(errs, fmt.Errorf("%s on %s, %d files: %w", c.Name, fsType, n, r.Err))
					}
					fmt.Fprintf(o.Progress, "scale: round %d %s\n", round+1, r.line())
					these = append(these, r)
				}
			}
			share.close()
			printScale(o.Out, share, configs, these, o.Opens)
			runs = append(runs, these...)
		}
	}
	return runs, errors.Join(errs...)
}

// runScale starts c's daemon on share, walks it and measures.
func (o *ScaleOptions) runScale(c ScaleConfig, share *scaleShare) ScaleRun {
	r := ScaleRun{Config: c.Name, FS: share.FS, Files: share.Files, Dirs: share.Dirs,
		LookupErrors: map[syscall.Errno]int{}, OpenErrors: map[syscall.Errno]int{}}
	d, err := StartDaemon(c.Config, c.Bin, share.Path, o.Dir, nil)
	if err != nil {
		r.Err = err
		return r
	}
	defer d.Stop()
	opts := c.targetOptions(128, 64)
	dev, err := vmm.Start(d.Sock, opts)
	if err != nil {
		r.Err = fmt.Errorf("connect: %w (log: %s)", err, d.Tail(20))
		return r
	}
	defer dev.Close()
	s := vmm.NewSession(dev, 1)
	if _, err := s.Init(vmm.KernelMinor, vmm.LinuxInitFlags); err != nil {
		r.Err = fmt.Errorf("INIT: %w", err)
		return r
	}
	time.Sleep(o.Settle)
	r.Nofile = nofileLimit(d.Pids())
	r.FDs[0], r.Mem[0], r.Slab[0] = countFDs(d.Pids()), ownMemory(d.Pids()), slabKiB()

	cpu0 := d.CPU()
	files, err := r.walk(s, share, o.Depth)
	r.LookupCPU = d.CPU() - cpu0
	if err != nil {
		r.Err = fmt.Errorf("%w (log: %s)", err, d.Tail(20))
		return r
	}
	time.Sleep(o.Settle) // no forced GC: the daemon's own settings decide
	r.FDs[1], r.Mem[1], r.Slab[1] = countFDs(d.Pids()), ownMemory(d.Pids()), slabKiB()

	for _, node := range files[:min(len(files), o.Opens)] {
		if _, err := s.Open(node, uint32(os.O_RDONLY)); err != nil {
			var fe *vmm.FuseError
			if !errors.As(err, &fe) {
				r.Err = fmt.Errorf("OPEN: %w (log: %s)", err, d.Tail(20))
				return r
			}
			r.OpenErrors[fe.Errno]++
			continue
		}
		r.Opened++
	}
	r.FDs[2] = countFDs(d.Pids())
	return r
}

// walk LOOKUPs every directory of the share and every file in it, keeping
// each lookup, and returns the node ids of the files found. With depth > 1,
// depth walkers share the directories (d, d+depth, ...), each with one
// request in flight.
func (r *ScaleRun) walk(s *vmm.Session, share *scaleShare, depth int) ([]uint64, error) {
	depth = max(depth, 1)
	parts := make([]ScaleRun, depth)
	found := make([][]uint64, depth)
	errs := make([]error, depth)
	var wg sync.WaitGroup
	start := time.Now()
	for w := range depth {
		parts[w].LookupErrors = map[syscall.Errno]int{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for d := w; d < share.Dirs && errs[w] == nil; d += depth {
				found[w], errs[w] = parts[w].walkDir(s, share, d, found[w])
			}
		}()
	}
	wg.Wait()
	r.LookupTime = time.Since(start)
	var files []uint64
	for w := range depth {
		r.Lookups += parts[w].Lookups
		r.Found += parts[w].Found
		for e, n := range parts[w].LookupErrors {
			r.LookupErrors[e] += n
		}
		files = append(files, found[w]...)
	}
	return files, errors.Join(errs...)
}

// walkDir LOOKUPs directory d and its files, appending their node ids to
// files.
func (r *ScaleRun) walkDir(s *vmm.Session, share *scaleShare, d int, files []uint64) ([]uint64, error) {
	lookup := func(parent uint64, name string) (uint64, error) {
		r.Lookups++
		e, err := s.Lookup(parent, name)
		if err != nil {
			var fe *vmm.FuseError
			if !errors.As(err, &fe) {
				return 0, fmt.Errorf("LOOKUP %s: %w", name, err)
			}
			r.LookupErrors[fe.Errno]++
			return 0, nil
		}
		r.Found++
		return e.NodeID, nil
	}
	dir, err := lookup(vmm.RootID, scaleDirName(d))
	if err != nil || dir == 0 {
		return files, err
	}
	for f := d * scaleDirFiles; f < min(share.Files, (d+1)*scaleDirFiles); f++ {
		node, err := lookup(dir, scaleFileName(f))
		if err != nil {
			return files, err
		}
		if node != 0 {
			files = append(files, node)
		}
	}
	return files, nil
}

func (r *ScaleRun) line() string {
	if r.Err != nil {
		return fmt.Sprintf("%-12s %-8s %8d files: ERROR %v", r.Config, r.FS, r.Files, r.Err)
	}
	return fmt.Sprintf("%-12s %-8s %8d files: nofile %d, fds %d/%d/%d, %.0f B/inode, slab %.0f B/inode, %.0f lookups/s, %.1f µs CPU/lookup, errors %s, opens %d (%s)",
		r.Config, r.FS, r.Files, r.Nofile, r.FDs[0], r.FDs[1], r.FDs[2], r.BytesPerInode(), r.SlabPerInode(),
		r.LookupRate(), r.LookupCost(), fmtErrnos(r.LookupErrors), r.Opened, fmtErrnos(r.OpenErrors))
}

// fmtErrnos is "EMFILE 80061, ENFILE 2", or "-".
func fmtErrnos(m map[syscall.Errno]int) string {
	if len(m) == 0 {
		return "-"
	}
	var parts []string
	for e, n := range m {
		parts = append(parts, fmt.Sprintf("%s %d", errnoName(e), n))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

func errnoName(e syscall.Errno) string {
	switch e {
	case syscall.EMFILE:
		return "EMFILE"
	case syscall.ENFILE:
		return "ENFILE"
	case syscall.ESTALE:
		return "ESTALE"
	case syscall.ENOENT:
		return "ENOENT"
	case syscall.EOPNOTSUPP:
		return "EOPNOTSUPP"
	}
	return "errno " + strconv.Itoa(int(e))
}
