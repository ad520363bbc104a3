//go:build linux

package e2e

// The machinery of the guest-boot tests: guest images (guest.sh), the daemon
// under test or the reference C daemon, QEMU with its console and monitor, and
// parsers for the console markers (guest-init.sh) and the daemon's slog lines.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

const (
	// Content of the file the host puts in the share as "hello".
	helloContent = "hello from the e2e host\n"
	// A TCG boot takes ~5-7 s here; this bounds a hung guest or daemon.
	defaultVMTimeout = 90 * time.Second
	// The daemon must exit on its own this soon after QEMU has gone.
	daemonExitTimeout = 5 * time.Second
	// Reference C daemon (Debian's qemu-system-common).
	referenceDaemon = "/usr/lib/qemu/virtiofsd"
)

var (
	testDir  string // test/e2e
	repoRoot string
)

func init() {
	wd, err := os.Getwd() // go test runs in the package directory
	if err != nil {
		panic(err)
	}
	testDir = wd
	repoRoot = filepath.Clean(filepath.Join(wd, "..", ".."))
}

// requireE2E skips unless running as root with GOVIRTIOFSD_E2E=1.
func requireE2E(t *testing.T) {
	t.Helper()
	if os.Getenv("GOVIRTIOFSD_E2E") != "1" {
		t.Skip("set GOVIRTIOFSD_E2E=1 to boot guests (make e2e)")
	}
	requireRoot(t)
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (vhost-user daemon, QEMU, initramfs build)")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Fatalf("qemu-system-x86_64 not found: %v (apt-get install qemu-system-x86)", err)
	}
}

// ---------------------------------------------------------------------------
// Guest images

type guestKernel struct {
	Version string // uname -r
	Vmlinuz string
	Initrd  string
}

var (
	kernelsOnce sync.Once
	kernelsList []guestKernel
	kernelsErr  error
)

// guestKernels runs guest.sh once per test binary (fast when its cache is warm)
// and returns the kernels it prepared, filtered by GOVIRTIOFSD_E2E_KERNELS
// (comma-separated prefixes of `uname -r`, e.g. "6.1.,6.12.").
func guestKernels(t *testing.T) []guestKernel {
	t.Helper()
	kernelsOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 9*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", filepath.Join(testDir, "guest.sh"))
		var stderr strings.Builder
		cmd.Stderr = &stderr
		start := time.Now()
		out, err := cmd.Output()
		if err != nil {
			kernelsErr = fmt.Errorf("guest.sh: %v\n%s", err, stderr.String())
			return
		}
		t.Logf("guest.sh took %.1fs", time.Since(start).Seconds())
		filter := strings.FieldsFunc(os.Getenv("GOVIRTIOFSD_E2E_KERNELS"), func(r rune) bool { return r == ',' || r == ' ' })
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Fields(line)
			if len(f) != 4 || f[0] != "KERNEL" {
				continue
			}
			k := guestKernel{Version: f[1], Vmlinuz: f[2], Initrd: f[3]}
			keep := len(filter) == 0
			for _, p := range filter {
				keep = keep || strings.HasPrefix(k.Version, p)
			}
			if keep {
				kernelsList = append(kernelsList, k)
			}
		}
		if len(kernelsList) == 0 {
			kernelsErr = fmt.Errorf("guest.sh prepared no kernel (filter %q); output:\n%s", filter, out)
		}
	})
	if kernelsErr != nil {
		t.Fatal(kernelsErr)
	}
	return kernelsList
}

// forEachKernel runs fn as one subtest per guest kernel, named by its version.
func forEachKernel(t *testing.T, fn func(t *testing.T, k guestKernel)) {
	for _, k := range guestKernels(t) {
		t.Run(k.Version, func(t *testing.T) { fn(t, k) })
	}
}

// ---------------------------------------------------------------------------
// Artifacts (kept after the run; the path is in the test log)

var (
	artifactsOnce sync.Once
	artifactsRoot string
)

func artifactDir(t *testing.T) string {
	t.Helper()
	artifactsOnce.Do(func() {
		artifactsRoot = os.Getenv("GOVIRTIOFSD_E2E_LOGDIR")
		if artifactsRoot == "" {
			artifactsRoot = filepath.Join(repoRoot, ".cache", "e2e-logs",
				time.Now().Format("20060102-150405")+"-"+strconv.Itoa(os.Getpid()))
		}
	})
	name := strings.NewReplacer("/", "__", " ", "_").Replace(t.Name())
	dir := filepath.Join(artifactsRoot, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("logs: %s", dir)
	return dir
}

// ---------------------------------------------------------------------------
// Daemons

type daemonKind int

const (
	ourDaemon daemonKind = iota
	refDaemon
	// altDaemon is another build of ours (GOVIRTIOFSD_BENCH_ALT), run
	// beside it for A/B benchmarks.
	altDaemon
)

func (k daemonKind) String() string {
	switch k {
	case refDaemon:
		return "reference"
	case altDaemon:
		return "govirtiofsd (alt)"
	}
	return "govirtiofsd"
}

type process struct {
	cmd      *exec.Cmd
	exited   chan struct{}
	waitErr  error
	exitTime time.Time
}

func startProcess(t *testing.T, cmd *exec.Cmd) *process {
	t.Helper()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", cmd.Path, err)
	}
	p := &process{cmd: cmd, exited: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		p.exitTime = time.Now()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-p.exited
		}
	})
	return p
}

func (p *process) running() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// wait waits up to d; ok is false if the process is still running.
func (p *process) wait(d time.Duration) (ok bool) {
	select {
	case <-p.exited:
		return true
	case <-time.After(d):
		return false
	}
}

func (p *process) kill() {
	if p.running() {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
}

func (p *process) exitCode() int {
	if p.running() {
		return -1
	}
	if p.waitErr == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(p.waitErr, &ee) {
		return ee.ExitCode() // -1 when killed by a signal
	}
	return -1
}

type daemon struct {
	*process
	kind    daemonKind
	sock    string
	logPath string
}

func ourDaemonBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("GOVIRTIOFSD_BIN")
	if bin == "" {
		bin = filepath.Join(testDir, "..", "..", "bin", "govirtiofsd")
	}
	bin, _ = filepath.Abs(bin)
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("daemon binary: %v (run make, or set GOVIRTIOFSD_BIN)", err)
	}
	return bin
}

// startDaemon starts the daemon of the given kind serving shared on sock,
// with stdout+stderr in logPath, and waits for the socket to appear. extra
// arguments follow the standard ones (each daemon's own spelling).
// GOVIRTIOFSD_E2E_DAEMON_ARGS adds arguments to our daemon's command line.
func startDaemon(t *testing.T, kind daemonKind, sock, shared, logPath string, extra ...string) *daemon {
	t.Helper()
	var cmd *exec.Cmd
	switch kind {
	case refDaemon:
		args := []string{"--socket-path=" + sock, "-o", "source=" + shared, "-o", "cache=none"}
		cmd = exec.Command(referenceDaemon, append(args, extra...)...)
	default:
		args := []string{"--socket-path", sock, "--shared-dir", shared, "--log-level", "debug"}
		args = append(args, extra...)
		args = append(args, strings.Fields(os.Getenv("GOVIRTIOFSD_E2E_DAEMON_ARGS"))...)
		bin := ourDaemonBinary(t)
		if kind == altDaemon {
			bin = os.Getenv("GOVIRTIOFSD_BENCH_ALT")
		}
		cmd = exec.Command(bin, args...)
	}
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	fmt.Fprintf(f, "# %s\n", strings.Join(cmd.Args, " "))
	cmd.Stdout, cmd.Stderr = f, f
	d := &daemon{process: startProcess(t, cmd), kind: kind, sock: sock, logPath: logPath}
	if kind == ourDaemon {
		// Ours runs in its default sandbox (--seccomp kill): a system
		// call outside the allowlist kills it, and its supervisor says
		// so. Whatever the test made of the dead daemon, say why.
		t.Cleanup(func() {
			if b, err := os.ReadFile(logPath); err == nil && strings.Contains(string(b), "killed by signal") {
				t.Errorf("govirtiofsd was killed (seccomp?): %s\n%s", logPath, tail(logPath, 5))
			}
		})
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if fi, err := os.Stat(sock); err == nil && fi.Mode()&os.ModeSocket != 0 {
			break
		}
		if !d.running() {
			t.Fatalf("%s exited before creating %s: %v\n%s", kind, sock, d.waitErr, tail(logPath, 30))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not create %s within 10s\n%s", kind, sock, tail(logPath, 30))
		}
		time.Sleep(20 * time.Millisecond)
	}
	return d
}

// fuseRequest is one `msg="fuse request"` line of our daemon's debug log.
type fuseRequest struct {
	Queue, Unique, Opcode, NodeID, Len string
	Error                              int // 0 or a negative errno
}

// fuseRequests parses the daemon log; the reference daemon has none.
func (d *daemon) fuseRequests(t *testing.T) []fuseRequest {
	t.Helper()
	data, err := os.ReadFile(d.logPath)
	if err != nil {
		t.Fatal(err)
	}
	var reqs []fuseRequest
	for _, line := range strings.Split(string(data), "\n") {
		kv := parseLogfmt(line)
		if kv["msg"] != "fuse request" {
			continue
		}
		r := fuseRequest{Queue: kv["queue"], Unique: kv["unique"], Opcode: kv["opcode"], NodeID: kv["nodeid"], Len: kv["len"]}
		if r.Error, err = strconv.Atoi(kv["error"]); err != nil {
			t.Fatalf("daemon log: bad error= in %q", line)
		}
		reqs = append(reqs, r)
	}
	return reqs
}

// lifecycleLines returns the daemon's connection and ring start/stop lines
// (for the test log only: their wording is the daemon's business).
func (d *daemon) lifecycleLines(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(d.logPath)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		kv := parseLogfmt(line)
		if m := kv["msg"]; strings.HasPrefix(m, "ring ") || strings.HasPrefix(m, "front end") {
			if i := strings.Index(line, "msg="); i >= 0 {
				line = line[i:]
			}
			out = append(out, line)
		}
	}
	return out
}

func filterOpcode(reqs []fuseRequest, op string) []fuseRequest {
	var out []fuseRequest
	for _, r := range reqs {
		if r.Opcode == op {
			out = append(out, r)
		}
	}
	return out
}

// parseLogfmt splits a slog TextHandler line into key=value pairs
// (values may be quoted Go strings).
func parseLogfmt(line string) map[string]string {
	kv := map[string]string{}
	for i := 0; i < len(line); {
		for i < len(line) && line[i] == ' ' {
			i++
		}
		j := i
		for j < len(line) && line[j] != '=' && line[j] != ' ' {
			j++
		}
		if j >= len(line) || line[j] != '=' {
			i = j
			continue
		}
		key := line[i:j]
		i = j + 1
		if i < len(line) && line[i] == '"' {
			k := i + 1
			for k < len(line) && line[k] != '"' {
				if line[k] == '\\' {
					k++
				}
				k++
			}
			if k >= len(line) {
				k = len(line) - 1
			}
			if v, err := strconv.Unquote(line[i : k+1]); err == nil {
				kv[key] = v
			} else {
				kv[key] = line[i : k+1]
			}
			i = k + 1
			continue
		}
		k := i
		for k < len(line) && line[k] != ' ' {
			k++
		}
		kv[key] = line[i:k]
		i = k
	}
	return kv
}

// ---------------------------------------------------------------------------
// QEMU

type vmConfig struct {
	Kernel      guestKernel
	Sock        string   // vhost-user socket
	Script      string   // guest-scripts/NAME.sh
	Append      []string // more kernel parameters
	AllowReboot bool     // without -no-reboot
	Timeout     time.Duration
	DeviceOpts  []string // more vhost-user-fs-pci properties, e.g. num-request-queues=2
	Tag         string   // virtio-fs tag (default myfs)
	// MemPath backs guest memory with memory-backend-file,mem-path=MemPath
	// (Kata's /dev/shm) instead of memory-backend-memfd.
	MemPath string
}

type vm struct {
	*process
	t           *testing.T
	stdin       io.WriteCloser
	monitor     string
	consolePath string
	started     time.Time
	timeout     time.Duration
	timedOut    atomic.Bool

	mu    sync.Mutex
	lines []string
	times []time.Time // when each line arrived
}

func vmTimeout() time.Duration {
	if s := os.Getenv("GOVIRTIOFSD_E2E_TIMEOUT"); s != "" {
		if d, err := time.ParseDuration(s); err == nil {
			return d
		}
	}
	return defaultVMTimeout
}

// startVM boots a guest; QEMU is killed after cfg.Timeout (default 90 s,
// GOVIRTIOFSD_E2E_TIMEOUT). Console output goes to dir/console.log.
func startVM(t *testing.T, dir string, cfg vmConfig) *vm {
	t.Helper()
	if cfg.Timeout == 0 {
		cfg.Timeout = vmTimeout()
	}
	mon := filepath.Join(filepath.Dir(cfg.Sock), "monitor.sock")
	tag := cfg.Tag
	if tag == "" {
		tag = "myfs"
	}
	mem := "memory-backend-memfd,id=mem,size=1G,share=on"
	if cfg.MemPath != "" {
		mem = "memory-backend-file,id=mem,size=1G,mem-path=" + cfg.MemPath + ",share=on"
	}
	appendLine := append([]string{"console=ttyS0", "panic=-1", "quiet", "e2e.tag=" + tag, "e2e.script=" + cfg.Script}, cfg.Append...)
	appendLine = append(appendLine, strings.Fields(os.Getenv("GOVIRTIOFSD_E2E_APPEND"))...)
	args := []string{
		"-accel", "tcg", "-m", "1G", "-smp", "2",
		// -nodefaults -display none -serial stdio: -nographic without the
		// default NIC (iPXE) and without terminal escape codes on stdout.
		"-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio",
		"-monitor", "unix:" + mon + ",server=on,wait=off",
		"-object", mem, "-numa", "node,memdev=mem",
		"-chardev", "socket,id=c0,path=" + cfg.Sock,
		"-device", strings.Join(append([]string{"vhost-user-fs-pci,chardev=c0,tag=" + tag + ",queue-size=1024"}, cfg.DeviceOpts...), ","),
		"-kernel", cfg.Kernel.Vmlinuz, "-initrd", cfg.Kernel.Initrd,
		"-append", strings.Join(appendLine, " "),
	}
	if !cfg.AllowReboot {
		args = append(args, "-no-reboot")
	}
	cmd := exec.Command("qemu-system-x86_64", args...)
	consolePath := filepath.Join(dir, "console.log")
	cf, err := os.Create(consolePath)
	if err != nil {
		t.Fatal(err)
	}
	_ = os.WriteFile(filepath.Join(dir, "qemu.cmdline"), []byte(shellQuote(cmd.Args)+"\n"), 0o644)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout // QEMU's own warnings land in the console log too
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	v := &vm{t: t, stdin: stdin, monitor: mon, consolePath: consolePath, started: time.Now()}
	v.process = startProcess(t, cmd)
	go v.readConsole(stdout, cf)
	v.timeout = cfg.Timeout
	go func() {
		select {
		case <-v.exited:
		case <-time.After(cfg.Timeout):
			v.timedOut.Store(true)
			v.kill()
		}
	}()
	return v
}

// reBootCrash matches a guest kernel that died (TCG now and then trips
// over an int3 while patching static keys at boot).
var reBootCrash = regexp.MustCompile(`Kernel panic|Oops: `)

// reDeviceCrash matches a guest crash whose instruction pointer or call
// trace is in the shared file system's device or FUSE code (a frame is
// function+offset; "Modules linked in: virtiofs fuse" is not one).
var reDeviceCrash = regexp.MustCompile(`\b_*(virtio|virtqueue|vring|vp_|fuse)\w*\+0x[0-9a-f]+`)

// diedBooting waits up to timeout until the guest's init has run
// (E2E-BOOT) or QEMU has ended, and reports whether the guest kernel died
// before its init ran in a way worth one more boot: TCG guests now and then
// trip over an int3 while patching static keys, before any FUSE request.
// A crash in the device's or FUSE's code is the daemon's business: it is
// not retried.
func (v *vm) diedBooting(timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		lines := v.consoleLines()
		if countMatches(lines, reBoot) > 0 {
			return false
		}
		if countMatches(lines, reBootCrash) > 0 || !v.running() {
			if countMatches(lines, reBootCrash) == 0 {
				return false
			}
			time.Sleep(time.Second) // the Oops text follows its first line
			crash := lastLines(v.consoleLines(), 40)
			if reDeviceCrash.MatchString(crash) {
				return false
			}
			v.t.Logf("guest kernel died while booting, before its init ran, outside device and FUSE code\n%s", crash)
			return true
		}
		time.Sleep(50 * time.Millisecond)
	}
	return false
}

// discardBoot ends a guest that died booting and its daemon, keeps their
// logs in dir as console-crashed.log and daemon-crashed.log, and removes
// the daemon's socket: startDaemon takes an existing socket for the new
// daemon's.
func discardBoot(t *testing.T, dir string, v *vm, d *daemon) {
	t.Logf("booting the guest again with a fresh daemon")
	v.kill()
	d.kill()
	for _, name := range []string{"console.log", "daemon.log"} {
		old := filepath.Join(dir, name)
		if err := os.Rename(old, strings.TrimSuffix(old, ".log")+"-crashed.log"); err != nil {
			t.Logf("keep the crashed boot's %s: %v", name, err)
		}
	}
	if err := os.Remove(d.sock); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
}

func (v *vm) readConsole(r io.Reader, f *os.File) {
	defer f.Close()
	br := bufio.NewReader(r)
	for {
		line, err := br.ReadString('\n')
		if line != "" {
			_, _ = f.WriteString(line)
			v.mu.Lock()
			v.lines = append(v.lines, strings.TrimRight(line, "\r\n"))
			v.times = append(v.times, time.Now())
			v.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

func (v *vm) consoleLines() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]string(nil), v.lines...)
}

// markerTimes returns, for each console line matching re, the time since
// QEMU started.
func (v *vm) markerTimes(re *regexp.Regexp) []time.Duration {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []time.Duration
	for i, l := range v.lines {
		if re.MatchString(l) {
			out = append(out, v.times[i].Sub(v.started).Round(100*time.Millisecond))
		}
	}
	return out
}

// stepDurations returns, per step name (suffixed "#2", "#3", ... when a name
// repeats), the time between its E2E-STEP-BEGIN and E2E-STEP lines as seen
// by the host.
func (v *vm) stepDurations() map[string]time.Duration {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := map[string]time.Duration{}
	begin := map[string]time.Time{}
	for i, l := range v.lines {
		if m := reBegin.FindStringSubmatch(l); m != nil {
			begin[m[1]] = v.times[i]
		} else if m := reStep.FindStringSubmatch(l); m != nil {
			if b, ok := begin[m[1]]; ok {
				name := m[1]
				for n := 2; ; n++ {
					if _, dup := out[name]; !dup {
						break
					}
					name = m[1] + "#" + strconv.Itoa(n)
				}
				out[name] = v.times[i].Sub(b)
				delete(begin, m[1])
			}
		}
	}
	return out
}

// waitConsole waits until the n-th (1-based) console line matching re
// appears; it fails the test if QEMU exits or the timeout passes first.
func (v *vm) waitConsole(re *regexp.Regexp, n int, timeout time.Duration) string {
	v.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		seen := 0
		for _, l := range v.consoleLines() {
			if re.MatchString(l) {
				if seen++; seen == n {
					return l
				}
			}
		}
		if !v.running() {
			if v.timedOut.Load() {
				v.t.Fatalf("QEMU killed after %v waiting for console line #%d matching %q\n%s", v.timeout, n, re, lastLines(v.consoleLines(), 25))
			}
			// Drain what the reader may still hold before giving up.
			time.Sleep(100 * time.Millisecond)
			if c := countMatches(v.consoleLines(), re); c >= n {
				continue
			}
			v.t.Fatalf("QEMU exited (%v) before console line #%d matching %q\n%s", v.waitErr, n, re, lastLines(v.consoleLines(), 25))
		}
		if time.Now().After(deadline) {
			v.t.Fatalf("no console line #%d matching %q within %v\n%s", n, re, timeout, lastLines(v.consoleLines(), 25))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// answer writes one line to the guest's console (read by e2e_ask).
func (v *vm) answer(s string) {
	v.t.Helper()
	if _, err := io.WriteString(v.stdin, s+"\n"); err != nil {
		v.t.Fatalf("write to guest console: %v", err)
	}
}

// quit sends `quit` to the QEMU monitor.
func (v *vm) quit() {
	v.t.Helper()
	c, err := net.DialTimeout("unix", v.monitor, 5*time.Second)
	if err != nil {
		v.t.Fatalf("QEMU monitor: %v", err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "quit\n"); err != nil {
		v.t.Fatalf("QEMU monitor: %v", err)
	}
	_, _ = io.Copy(io.Discard, c) // QEMU closes the monitor as it exits
}

// waitExit waits for QEMU to exit (the hard timeout kills it) and requires
// exit status 0.
func (v *vm) waitExit() {
	v.t.Helper()
	<-v.exited
	// Let the console reader finish.
	time.Sleep(50 * time.Millisecond)
	if v.timedOut.Load() {
		v.t.Fatalf("QEMU still running after %v: killed (hung guest or daemon?)\n%s", v.timeout, lastLines(v.consoleLines(), 25))
	}
	if c := v.exitCode(); c != 0 {
		v.t.Fatalf("QEMU exit status %d (%v)\n%s", c, v.waitErr, lastLines(v.consoleLines(), 25))
	}
}

// ---------------------------------------------------------------------------
// Console markers (see guest-init.sh)

var (
	reBoot    = regexp.MustCompile(`E2E-BOOT kernel=(\S+) uptime=(\S+)`)
	reBegin   = regexp.MustCompile(`E2E-STEP-BEGIN (\S+)`)
	reStep    = regexp.MustCompile(`E2E-STEP (\S+) rc=(\d+)`)
	reMounted = regexp.MustCompile(`E2E-MOUNTED tag=(\S+) uptime=(\S+)`)
	reAsk     = regexp.MustCompile(`E2E-ASK (\S+)`)
	reDone    = regexp.MustCompile(`E2E-DONE action=(\S+) uptime=(\S+)`)
)

type guestStep struct {
	Boot   int // 1-based
	Name   string
	RC     int
	Output []string
}

type guestRun struct {
	Boots   int
	Uptimes []string // kernel uptime at E2E-MOUNTED, per boot
	Steps   []guestStep
	Done    []string // E2E-DONE actions
}

func parseConsole(lines []string) guestRun {
	var g guestRun
	var cur *guestStep
	for _, l := range lines {
		switch {
		case reBoot.MatchString(l):
			g.Boots++
			cur = nil
		case reBegin.MatchString(l):
			cur = &guestStep{Boot: g.Boots, Name: reBegin.FindStringSubmatch(l)[1], RC: -1}
		case reStep.MatchString(l):
			m := reStep.FindStringSubmatch(l)
			rc, _ := strconv.Atoi(m[2])
			if cur == nil || cur.Name != m[1] {
				cur = &guestStep{Boot: g.Boots, Name: m[1]}
			}
			cur.RC = rc
			g.Steps = append(g.Steps, *cur)
			cur = nil
		case reMounted.MatchString(l):
			g.Uptimes = append(g.Uptimes, reMounted.FindStringSubmatch(l)[2])
		case reDone.MatchString(l):
			g.Done = append(g.Done, reDone.FindStringSubmatch(l)[1])
		case cur != nil:
			cur.Output = append(cur.Output, l)
		}
	}
	return g
}

// step returns the named step of the given boot (fails the test if absent).
func (g guestRun) step(t *testing.T, boot int, name string) guestStep {
	t.Helper()
	for _, s := range g.Steps {
		if s.Boot == boot && s.Name == name {
			return s
		}
	}
	t.Fatalf("guest boot %d has no step %q (steps: %+v)", boot, name, g.Steps)
	return guestStep{}
}

// ---------------------------------------------------------------------------
// Helpers

func countMatches(lines []string, re *regexp.Regexp) int {
	n := 0
	for _, l := range lines {
		if re.MatchString(l) {
			n++
		}
	}
	return n
}

func lastLines(lines []string, n int) string {
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "  | " + strings.Join(lines, "\n  | ")
}

func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return lastLines(strings.Split(strings.TrimRight(string(data), "\n"), "\n"), n)
}

func shellQuote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.IndexFunc(a, func(r rune) bool {
			return !(r == '-' || r == '_' || r == '.' || r == '/' || r == '=' || r == ',' || r == ':' || r == '+' ||
				(r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9'))
		}) < 0 {
			q[i] = a
		} else {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(q, " ")
}
