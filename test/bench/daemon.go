package bench

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
)

// Config is one daemon configuration of the side-by-side run.
type Config struct {
	Name string
	Ours bool
	// Rust: the Rust virtiofsd (SuiteOptions.RustBin), with its own long
	// options; neither Ours nor Rust: the reference C daemon.
	Rust  bool
	Pool  int // --thread-pool-size; <0: not passed (the daemon's default)
	Rings int // request rings the front end sets up
	// Packed: the front end asks for packed rings (VIRTIO_F_RING_PACKED)
	// and fails if the daemon does not offer them.
	Packed bool
	Bin    string   // binary, if not SuiteOptions' (an A/B build of ours)
	Extra  []string // more arguments (SuiteOptions.ProfileDir)
}

// Label is a short column heading.
func (c Config) Label() string { return c.Name }

// Args returns the daemon's command line (after the binary): cache none,
// the pool size, then Extra.
func (c Config) Args(sock, share string) []string {
	line := launch.Line{Kind: launch.Reference, Socket: sock, Share: share, Cache: "never", Extra: c.Extra}
	switch {
	case c.Ours:
		line.Kind = launch.Ours
	case c.Rust:
		line.Kind = launch.Rust // its default sandbox (namespace) and seccomp (kill) work here
	}
	if c.Pool >= 0 {
		line.Extra = append([]string{"--thread-pool-size=" + strconv.Itoa(c.Pool)}, c.Extra...)
	}
	return line.Args()
}

// Daemon is a running back end.
type Daemon struct {
	*launch.Process
	Cfg  Config
	Sock string
}

// StartDaemon launches bin with cfg's arguments, logging to a file in dir
// (each run's log after the last's). Extra environment entries are
// appended to ours.
func StartDaemon(cfg Config, bin, share, dir string, env []string) (*Daemon, error) {
	sock := filepath.Join(dir, cfg.Name+".sock")
	os.Remove(sock)
	p, err := launch.Spec{Bin: bin, Args: cfg.Args(sock, share), Env: env, Group: true,
		Log: filepath.Join(dir, cfg.Name+".log"), Append: true}.Start()
	if err != nil {
		return nil, err
	}
	d := &Daemon{Process: p, Cfg: cfg, Sock: sock}
	if err := p.WaitSocket(sock, 10*time.Second); err != nil {
		d.Stop()
		return nil, fmt.Errorf("%s: %w", cfg.Name, err)
	}
	return d, nil
}

// Stop waits briefly for the daemon to exit by itself (ours does once the
// front end disconnects; the reference takes longer), then terminates its
// process group.
func (d *Daemon) Stop() {
	d.Process.Stop(300*time.Millisecond, launch.Step{Signal: unix.SIGTERM, Wait: 2 * time.Second})
}

// Pids returns the daemon's process and all its descendants (a sandboxed
// daemon's supervisor and its child).
func (d *Daemon) Pids() []int { return ProcessTree(d.Pid()) }

// ProcessTree returns root and its descendants, from the ppid field of
// /proc/*/stat.
func ProcessTree(root int) []int {
	children := map[int][]int{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		if f := statFields(b); len(f) > 2 {
			if ppid, err := strconv.Atoi(f[1]); err == nil {
				children[ppid] = append(children[ppid], pid)
			}
		}
	}
	tree := []int{root}
	for i := 0; i < len(tree); i++ {
		tree = append(tree, children[tree[i]]...)
	}
	return tree
}

// statFields returns the fields of /proc/PID/stat after the command name
// (field 3, state, is index 0).
func statFields(b []byte) []string {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// Mem is memory summed over processes, in KiB.
type Mem struct{ RssAnon, RssShmem, RssFile, VmRSS, Procs, Threads int }

// Memory reads the memory of every process of the daemon.
func (d *Daemon) Memory() Mem { return ProcessMemory(d.Pids()) }

// ProcessMemory sums /proc/PID/status over pids; a process that has just
// exited is skipped.
func ProcessMemory(pids []int) Mem {
	var m Mem
	for _, pid := range pids {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		m.Procs++
		procFields(data, func(k string, v int64) {
			n := int(v)
			switch k {
			case "RssAnon":
				m.RssAnon += n
			case "RssShmem":
				m.RssShmem += n
			case "RssFile":
				m.RssFile += n
			case "VmRSS":
				m.VmRSS += n
			case "Threads":
				m.Threads += n
			}
		})
	}
	return m
}

// procFields calls fn with each "key: number [kB]" line of a /proc file
// (status, sched); lines whose value is not a number give 0.
func procFields(data []byte, fn func(key string, n int64)) {
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		fn(strings.TrimSpace(k), n)
	}
}

// CPU returns user+system time of the daemon's processes so far.
func (d *Daemon) CPU() time.Duration {
	var ticks int64
	for _, pid := range d.Pids() {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		f := statFields(b)
		if len(f) > 12 {
			u, _ := strconv.ParseInt(f[11], 10, 64) // utime (field 14)
			s, _ := strconv.ParseInt(f[12], 10, 64) // stime (field 15)
			ticks += u + s
		}
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

// selfCPU is this process's user+system time.
func selfCPU() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// systemCPU is the busy time of all CPUs (user, nice, system, irq,
// softirq, steal) from /proc/stat.
func systemCPU() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	var busy int64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		if i >= 8 { // guest time is already in user
			break
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		busy += n
	}
	return time.Duration(busy) * time.Second / 100
}
