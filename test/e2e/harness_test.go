//go:build linux

package e2e

// The machinery of the guest-boot tests: guest images (guest.sh), the daemon
// under test or the reference C daemon, QEMU with its console and monitor, and
// parsers for the console markers (guest-init.sh) and the daemon's slog lines.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
)

const (
	// Content of the file the host puts in the share as "hello".
	helloContent = "hello from the e2e host\n"
	// A TCG boot takes ~5-7 s here; this bounds a hung guest or daemon.
	defaultVMTimeout = 90 * time.Second
	// The daemon must exit on its own this soon after QEMU has gone.
	daemonExitTimeout = 5 * time.Second
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

// guestKernels returns the Linux 6.x kernels allGuestKernels prepared: the
// ones the tests on QEMU 7.2 and 10 boot (forEachKernel, newestKernelAtLeast).
// Linux 7.x runs only in the tests that ask for it (newestKernel7, on QEMU
// 11): adding it here would add a boot to every test of the 6.x matrix.
func guestKernels(t *testing.T) []guestKernel {
	t.Helper()
	var ks []guestKernel
	for _, k := range allGuestKernels(t) {
		if !kernelAtLeast(k.Version, 7, 0) {
			ks = append(ks, k)
		}
	}
	if len(ks) == 0 {
		t.Skip("no Linux 6.x guest kernel prepared (see GOVIRTIOFSD_E2E_KERNELS)")
	}
	return ks
}

// newestKernel7 returns the newest prepared Linux 7.x guest kernel (guest.sh
// series 7, from Debian sid), or skips the test.
func newestKernel7(t *testing.T) guestKernel {
	t.Helper()
	var k guestKernel
	for _, gk := range allGuestKernels(t) {
		if kernelAtLeast(gk.Version, 7, 0) && !kernelAtLeast(gk.Version, 8, 0) {
			k = gk
		}
	}
	if k.Version == "" {
		t.Skip("no Linux 7.x guest kernel prepared (guest.sh series 7; see GOVIRTIOFSD_E2E_KERNELS)")
	}
	return k
}

// allGuestKernels runs guest.sh once per test binary (fast when its cache is
// warm) and returns the kernels it prepared, filtered by
// GOVIRTIOFSD_E2E_KERNELS (comma-separated prefixes of `uname -r`, e.g.
// "6.1.,6.12.,7.").
func allGuestKernels(t *testing.T) []guestKernel {
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
	// rustDaemon is the Rust virtiofsd 1.13 (make test-deps) in its
	// default sandbox (namespace, seccomp kill), --cache never.
	rustDaemon
	// rust114Daemon is the Rust virtiofsd 1.14 (make test-deps; sid),
	// started as rustDaemon is.
	rust114Daemon
)

func (k daemonKind) String() string {
	switch k {
	case refDaemon:
		return "reference"
	case altDaemon:
		return "govirtiofsd (alt)"
	case rustDaemon:
		return "virtiofsd (Rust)"
	case rust114Daemon:
		return "virtiofsd (Rust 1.14)"
	}
	return "govirtiofsd"
}

// ---------------------------------------------------------------------------
// Peers fetched by make test-deps (test/peers.sh)

// peersDir is where test/peers.sh put QEMU 10 and the Rust virtiofsd
// (GOVIRTIOFSD_PEERS, default .cache/peers).
func peersDir() string {
	if d := os.Getenv("GOVIRTIOFSD_PEERS"); d != "" {
		return d
	}
	return filepath.Join(repoRoot, ".cache", "peers")
}

// peersBin returns one of test/peers.sh's wrappers (bin/NAME); it fails the
// test if make test-deps has not made it.
func peersBin(t *testing.T, name string) string {
	t.Helper()
	p := filepath.Join(peersDir(), "bin", name)
	if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
		t.Fatalf("%s: not there or not executable (%v): run make test-deps (test/peers.sh fetches QEMU 10 and the Rust virtiofsd)", p, err)
	}
	return p
}

const (
	qemu10Wrapper  = "qemu-system-x86_64-10"
	qemu11Wrapper  = "qemu-system-x86_64-11"
	rustDaemonName = "virtiofsd-rust"
	rust114Name    = "virtiofsd-rust-1.14"
)

type daemon struct {
	*launch.Process
	kind daemonKind
	sock string
}

func ourDaemonBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("GOVIRTIOFSD_BIN")
	if bin == "" {
		bin = filepath.Join(repoRoot, "bin", "govirtiofsd")
	}
	bin, err := launch.Existing(bin)
	if err != nil {
		t.Fatalf("daemon binary: %v (run make, or set GOVIRTIOFSD_BIN)", err)
	}
	return bin
}

// startDaemon starts the daemon of the given kind serving shared on sock,
// with stdout+stderr in logPath, and waits for the socket to appear. extra
// arguments follow the standard ones (each daemon's own spelling); the C
// and the Rust daemon run with cache none unless extra names a cache mode.
// GOVIRTIOFSD_E2E_DAEMON_ARGS adds arguments to our daemon's command line.
func startDaemon(t *testing.T, kind daemonKind, sock, shared, logPath string, extra ...string) *daemon {
	t.Helper()
	line := launch.Line{Kind: launch.Ours, Socket: sock, Share: shared, Extra: extra}
	var bin string
	switch kind {
	case refDaemon:
		line.Kind, bin = launch.Reference, launch.ReferenceBin
	case rustDaemon:
		line.Kind, bin = launch.Rust, peersBin(t, rustDaemonName)
	case rust114Daemon:
		line.Kind, bin = launch.Rust, peersBin(t, rust114Name)
	case altDaemon:
		bin = os.Getenv("GOVIRTIOFSD_BENCH_ALT")
	default:
		bin = ourDaemonBinary(t)
	}
	if line.Kind == launch.Ours {
		line.Extra = append(append([]string{"--log-level", "debug"}, extra...), strings.Fields(os.Getenv("GOVIRTIOFSD_E2E_DAEMON_ARGS"))...)
	} else if !slices.ContainsFunc(extra, func(a string) bool { return a == "--cache" || strings.HasPrefix(a, "cache=") }) {
		line.Cache = "never"
	}
	p, err := launch.Spec{Bin: bin, Args: line.Args(), Group: true, Log: logPath, Header: true}.Start()
	if err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	t.Cleanup(p.Kill)
	d := &daemon{Process: p, kind: kind, sock: sock}
	if kind == ourDaemon {
		// Ours runs in its default sandbox (--seccomp kill): a system
		// call outside the allowlist kills it, and its supervisor says
		// so. Whatever the test made of the dead daemon, say why.
		t.Cleanup(func() {
			if strings.Contains(d.Log(), "killed by signal") {
				t.Errorf("govirtiofsd was killed (seccomp?): %s\n%s", logPath, tail(logPath, 5))
			}
		})
	}
	if err := d.WaitSocket(sock, 10*time.Second); err != nil {
		t.Fatalf("%s: %v", kind, err)
	}
	return d
}

// reRustRequest is the Rust virtiofsd's debug line for a request (its log
// names no node id a reply hands out).
var reRustRequest = regexp.MustCompile(`Received request: opcode=(\w+) \(\d+\), inode=(\d+), unique=(\d+)`)

// fuseRequest is one `msg="fuse request"` line of our daemon's debug log,
// or a Rust daemon's "Received request" line.
type fuseRequest struct {
	Queue, Unique, Opcode, NodeID, Len string
	Entry                              string // the node id the reply handed out (LOOKUP, CREATE...), if any
	Error                              int    // 0 or a negative errno
}

// fuseRequests parses the daemon log; the reference daemon has none.
func (d *daemon) fuseRequests(t *testing.T) []fuseRequest {
	t.Helper()
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	var reqs []fuseRequest
	for _, line := range strings.Split(string(data), "\n") {
		if d.kind == rustDaemon || d.kind == rust114Daemon {
			// "Received request: opcode=Read (15), inode=N, unique=..."
			if m := reRustRequest.FindStringSubmatch(line); m != nil {
				reqs = append(reqs, fuseRequest{Opcode: strings.ToUpper(m[1]), NodeID: m[2], Unique: m[3]})
			}
			continue
		}
		kv := parseLogfmt(line)
		if kv["msg"] != "fuse request" {
			continue
		}
		r := fuseRequest{Queue: kv["queue"], Unique: kv["unique"], Opcode: kv["opcode"], NodeID: kv["nodeid"], Len: kv["len"],
			Entry: kv["entry"]}
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
	data, err := os.ReadFile(d.LogPath)
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

// logSize is the daemon log's current length: an offset for vhostMessages.
func (d *daemon) logSize(t *testing.T) int64 {
	t.Helper()
	fi, err := os.Stat(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// vhostMessage is one `msg="vhost-user message"` debug line of our daemon
// (or a `msg="vhost-user message refused"` warning: Refused).
type vhostMessage struct {
	Request, Size, FDs string
	Refused            string // the error, for a refused message
}

func (m vhostMessage) String() string {
	s := m.Request + " size=" + m.Size + " fds=" + m.FDs
	if m.Refused != "" {
		s = m.Request + " REFUSED: " + m.Refused
	}
	return s
}

// vhostMessages returns the vhost-user messages the daemon logged between
// the log offsets from and to (to < 0: the end), in order.
func (d *daemon) vhostMessages(t *testing.T, from, to int64) []vhostMessage {
	t.Helper()
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	if to < 0 || to > int64(len(data)) {
		to = int64(len(data))
	}
	from = min(from, to)
	var out []vhostMessage
	for _, line := range strings.Split(string(data[from:to]), "\n") {
		kv := parseLogfmt(line)
		switch kv["msg"] {
		case "vhost-user message":
			out = append(out, vhostMessage{Request: kv["request"], Size: kv["size"], FDs: kv["fds"]})
		case "vhost-user message refused":
			out = append(out, vhostMessage{Request: kv["request"], Refused: kv["err"]})
		}
	}
	return out
}

// compactSequence writes a sequence of names compactly: a run of a repeated
// block becomes "(A B)x3", a repeated name "Ax2".
func compactSequence(names []string) string {
	var parts []string
	for i := 0; i < len(names); {
		bestL, bestK := 1, 1
		for l := 1; l <= 8 && i+2*l <= len(names); l++ {
			k := 1
			for i+(k+1)*l <= len(names) && slices.Equal(names[i:i+l], names[i+k*l:i+(k+1)*l]) {
				k++
			}
			if k > 1 && l*k > bestL*bestK {
				bestL, bestK = l, k
			}
		}
		block := strings.Join(names[i:i+bestL], " ")
		switch {
		case bestK == 1:
			parts = append(parts, block)
		case bestL == 1:
			parts = append(parts, fmt.Sprintf("%sx%d", block, bestK))
		default:
			parts = append(parts, fmt.Sprintf("(%s)x%d", block, bestK))
		}
		i += bestL * bestK
	}
	return strings.Join(parts, " ")
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

// qemuVersion chooses the QEMU a guest runs under.
type qemuVersion int

const (
	// qemu72 is the system's QEMU 7.2 (Debian 12), the default.
	qemu72 qemuVersion = iota
	// qemu10 is QEMU 10.x from bookworm-backports, through test/peers.sh's
	// wrapper (make test-deps): needed for live migration (QEMU >= 8.2).
	qemu10
	// qemu11 is QEMU 11.x from sid with its own libraries, through
	// test/peers.sh's wrapper (make test-deps); it runs the Linux 7.x guest.
	qemu11
)

func (q qemuVersion) String() string {
	switch q {
	case qemu10:
		return "QEMU 10"
	case qemu11:
		return "QEMU 11"
	}
	return "QEMU 7.2"
}

// binary returns the QEMU executable; QEMU 10 fails the test without make
// test-deps.
func (q qemuVersion) binary(t *testing.T) string {
	t.Helper()
	switch q {
	case qemu10:
		return peersBin(t, qemu10Wrapper)
	case qemu11:
		return peersBin(t, qemu11Wrapper)
	}
	return "qemu-system-x86_64"
}

type vmConfig struct {
	Kernel      guestKernel
	Sock        string   // vhost-user socket
	Script      string   // guest-scripts/NAME.sh
	Append      []string // more kernel parameters
	AllowReboot bool     // without -no-reboot
	Timeout     time.Duration
	DeviceOpts  []string // more vhost-user-fs-pci properties, e.g. num-request-queues=2
	Tag         string   // virtio-fs tag (default myfs)
	// Packed asks for packed virtqueues (packed=on on vhost-user-fs-pci;
	// QEMU 10 only here). QEMU uses them only if the back end offers
	// VIRTIO_F_RING_PACKED (bit 34) and silently falls back to split rings
	// otherwise: a test that sets it checks the guest's features
	// (requirePacked).
	Packed bool
	// MemPath backs guest memory with memory-backend-file,mem-path=MemPath
	// (Kata's /dev/shm) instead of memory-backend-memfd.
	MemPath string
	// QEMU is the QEMU to run (default the system's 7.2).
	QEMU qemuVersion
	// Incoming makes this a migration destination: -incoming unix:Incoming.
	// Such a QEMU waits for the source's state and then runs the guest
	// (its console continues the source's; see guestConsole).
	Incoming string
	// Trace enables QEMU trace events (-trace PATTERN each), logged with
	// their timestamps to qemu-trace.log (qemu-trace-NAME.log) in the
	// artifact directory, e.g. vhost_user_read, vhost_user_write.
	Trace []string
	// Generic replaces vhost-user-fs-pci with QEMU 11's generic vhost-user
	// device as a virtio-fs device (DESIGN.md §13), the only one that
	// gets the daemon's shared-memory (DAX) window:
	// vhost-user-test-device-pci,virtio-id=26,num_vqs=1+GenericQueues,
	// config_size=40,vq_size=1024. The tag and the number of request
	// queues come from the daemon's config (GET_CONFIG): the daemon needs
	// --tag (Tag is only the guest's mount source). QEMU 11 only.
	Generic bool
	// GenericQueues is the request queues of the generic device (0: 1).
	GenericQueues int
	// Name tells the artifacts of several QEMUs in one directory apart:
	// console-NAME.log, qemu-NAME.cmdline, and the monitor and QMP sockets
	// (monitor-NAME.sock, qmp-NAME.sock beside Sock). Empty: console.log,
	// qemu.cmdline, monitor.sock, qmp.sock.
	Name string
}

type vm struct {
	*launch.Process
	t           *testing.T
	name        string
	stdin       io.WriteCloser
	monitor     string // HMP socket
	qmpPath     string // QMP socket (qmp() dials it)
	consolePath string
	tracePath   string // QEMU's trace log ("" without vmConfig.Trace)
	started     time.Time
	timeout     time.Duration
	timedOut    atomic.Bool

	mu      sync.Mutex
	lines   []string
	times   []time.Time // when each line arrived
	partial bool        // the last line ended at EOF without a newline

	qmpOnce sync.Once
	qmpc    *qmpClient
	qmpErr  error
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
	suffix := ""
	if cfg.Name != "" {
		suffix = "-" + cfg.Name
	}
	mon := filepath.Join(filepath.Dir(cfg.Sock), "monitor"+suffix+".sock")
	qmpPath := filepath.Join(filepath.Dir(cfg.Sock), "qmp"+suffix+".sock")
	tag := cfg.Tag
	if tag == "" {
		tag = "myfs"
	}
	devOpts := cfg.DeviceOpts
	if cfg.Packed {
		if cfg.QEMU != qemu10 && cfg.QEMU != qemu11 {
			t.Fatalf("vmConfig.Packed: packed virtqueues are tested under QEMU 10 and 11 only (set QEMU: qemu10 or qemu11)")
		}
		devOpts = append(slices.Clone(devOpts), "packed=on")
	}
	device := "vhost-user-fs-pci,chardev=c0,tag=" + tag + ",queue-size=1024"
	if cfg.Generic {
		if cfg.QEMU != qemu11 {
			t.Fatalf("vmConfig.Generic: the generic device with virtio-fs's config is tested under QEMU 11 only")
		}
		device = fmt.Sprintf("vhost-user-test-device-pci,chardev=c0,virtio-id=26,num_vqs=%d,config_size=40,vq_size=1024",
			1+max(cfg.GenericQueues, 1))
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
		"-qmp", "unix:" + qmpPath + ",server=on,wait=off",
		"-object", mem, "-numa", "node,memdev=mem",
		"-chardev", "socket,id=c0,path=" + cfg.Sock,
		"-device", strings.Join(append([]string{device}, devOpts...), ","),
		"-kernel", cfg.Kernel.Vmlinuz, "-initrd", cfg.Kernel.Initrd,
		"-append", strings.Join(appendLine, " "),
	}
	if !cfg.AllowReboot {
		args = append(args, "-no-reboot")
	}
	if cfg.Incoming != "" {
		args = append(args, "-incoming", "unix:"+cfg.Incoming)
	}
	for _, ev := range cfg.Trace {
		if cfg.QEMU == qemu11 {
			// QEMU 11 split vhost_dev_start/stop into _in and _out
			// (readQEMUTrace reads the _in ones under the old names).
			if n, ok := qemu11TraceNames[ev]; ok {
				ev = n
			}
		}
		args = append(args, "-trace", ev)
	}
	if len(cfg.Trace) > 0 {
		args = append(args, "-D", filepath.Join(dir, "qemu-trace"+suffix+".log"), "-msg", "timestamp=on")
	}
	cmd := launch.Spec{Bin: cfg.QEMU.binary(t), Args: args, Group: true}.Command()
	consolePath := filepath.Join(dir, "console"+suffix+".log")
	cf, err := os.Create(consolePath)
	if err != nil {
		t.Fatal(err)
	}
	_ = os.WriteFile(filepath.Join(dir, "qemu"+suffix+".cmdline"), []byte(launch.ShellQuote(cmd.Args)+"\n"), 0o644)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout // QEMU's own warnings land in the console log too
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	v := &vm{t: t, name: cfg.Name, stdin: stdin, monitor: mon, qmpPath: qmpPath, consolePath: consolePath, started: time.Now()}
	if len(cfg.Trace) > 0 {
		v.tracePath = filepath.Join(dir, "qemu-trace"+suffix+".log")
	}
	if v.Process, err = launch.Start(cmd); err != nil {
		t.Fatalf("start %s: %v", cmd.Path, err)
	}
	t.Cleanup(v.Kill)
	go v.readConsole(stdout, cf)
	v.timeout = cfg.Timeout
	go func() {
		select {
		case <-v.Done():
		case <-time.After(cfg.Timeout):
			v.timedOut.Store(true)
			v.Kill()
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
		if countMatches(lines, reBootCrash) > 0 || !v.Running() {
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
	v.Kill()
	d.Kill()
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
			v.partial = !strings.HasSuffix(line, "\n")
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
		if !v.Running() {
			if v.timedOut.Load() {
				v.t.Fatalf("QEMU killed after %v waiting for console line #%d matching %q\n%s", v.timeout, n, re, lastLines(v.consoleLines(), 25))
			}
			// Drain what the reader may still hold before giving up.
			time.Sleep(100 * time.Millisecond)
			if c := countMatches(v.consoleLines(), re); c >= n {
				continue
			}
			v.t.Fatalf("QEMU exited (%v) before console line #%d matching %q\n%s", v.Err(), n, re, lastLines(v.consoleLines(), 25))
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
	<-v.Done()
	// Let the console reader finish.
	time.Sleep(50 * time.Millisecond)
	if v.timedOut.Load() {
		v.t.Fatalf("QEMU still running after %v: killed (hung guest or daemon?)\n%s", v.timeout, lastLines(v.consoleLines(), 25))
	}
	if c := v.Status().Code; c != 0 {
		v.t.Fatalf("QEMU exit status %d (%v)\n%s", c, v.Err(), lastLines(v.consoleLines(), 25))
	}
}

// ---------------------------------------------------------------------------
// QMP (-qmp unix:PATH,server=on,wait=off on every QEMU)

// qmpTimeout bounds one QMP command (and the connection's greeting).
const qmpTimeout = 15 * time.Second

// qmpClient speaks QMP on one connection: the greeting, qmp_capabilities,
// then one command at a time; events that arrive meanwhile are kept.
type qmpClient struct {
	mu     sync.Mutex
	conn   net.Conn
	dec    *json.Decoder
	events []qmpEvent
}

type qmpEvent struct {
	Event string
	Data  json.RawMessage
	At    time.Time // QEMU's timestamp
}

// qmpError is a command's {"error": {"class", "desc"}} answer.
type qmpError struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *qmpError) Error() string { return e.Class + ": " + e.Desc }

// dialQMP connects to a QMP socket (retrying until QEMU has made it),
// reads the greeting and enters command mode.
func dialQMP(path string, timeout time.Duration) (*qmpClient, error) {
	deadline := time.Now().Add(timeout)
	var c net.Conn
	for {
		var err error
		if c, err = net.Dial("unix", path); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("QMP %s: %w", path, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	q := &qmpClient{conn: c, dec: json.NewDecoder(c)}
	_ = c.SetDeadline(deadline)
	var greeting map[string]json.RawMessage
	if err := q.dec.Decode(&greeting); err != nil {
		c.Close()
		return nil, fmt.Errorf("QMP %s: greeting: %w", path, err)
	}
	if _, ok := greeting["QMP"]; !ok {
		c.Close()
		return nil, fmt.Errorf("QMP %s: not a QMP greeting: %v", path, greeting)
	}
	if _, err := q.execute("qmp_capabilities", nil, time.Until(deadline)); err != nil {
		c.Close()
		return nil, err
	}
	return q, nil
}

// execute runs one command and returns its "return" value; an "error"
// answer is a *qmpError. Events read before the answer are kept.
func (q *qmpClient) execute(cmd string, args any, timeout time.Duration) (json.RawMessage, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if _, err := q.conn.Write(append(b, '\n')); err != nil {
		return nil, fmt.Errorf("QMP %s: %w", cmd, err)
	}
	for {
		var msg struct {
			Return    json.RawMessage `json:"return"`
			Error     *qmpError       `json:"error"`
			Event     string          `json:"event"`
			Data      json.RawMessage `json:"data"`
			Timestamp struct {
				Seconds      int64 `json:"seconds"`
				Microseconds int64 `json:"microseconds"`
			} `json:"timestamp"`
		}
		if err := q.dec.Decode(&msg); err != nil {
			return nil, fmt.Errorf("QMP %s: %w", cmd, err)
		}
		switch {
		case msg.Event != "":
			at := time.Unix(msg.Timestamp.Seconds, msg.Timestamp.Microseconds*1000)
			q.events = append(q.events, qmpEvent{Event: msg.Event, Data: msg.Data, At: at})
		case msg.Error != nil:
			return nil, fmt.Errorf("QMP %s: %w", cmd, msg.Error)
		case msg.Return != nil:
			return msg.Return, nil
		}
	}
}

func (q *qmpClient) close() { q.conn.Close() }

// qmp returns the VM's QMP connection (made on first use).
func (v *vm) qmp() *qmpClient {
	v.t.Helper()
	v.qmpOnce.Do(func() {
		v.qmpc, v.qmpErr = dialQMP(v.qmpPath, qmpTimeout)
		if v.qmpErr == nil {
			v.t.Cleanup(v.qmpc.close)
		}
	})
	if v.qmpErr != nil {
		v.t.Fatalf("%s: %v", v.label(), v.qmpErr)
	}
	return v.qmpc
}

// qmpTry runs a QMP command and returns its error, if any.
func (v *vm) qmpTry(cmd string, args any) (json.RawMessage, error) {
	v.t.Helper()
	return v.qmp().execute(cmd, args, qmpTimeout)
}

// qmpExec runs a QMP command; an error fails the test.
func (v *vm) qmpExec(cmd string, args any) json.RawMessage {
	v.t.Helper()
	r, err := v.qmpTry(cmd, args)
	if err != nil {
		v.t.Fatalf("%s: %v", v.label(), err)
	}
	return r
}

// qmpQuit ends QEMU with the QMP quit command.
func (v *vm) qmpQuit() {
	v.t.Helper()
	if _, err := v.qmpTry("quit", nil); err != nil && v.Running() {
		v.t.Fatalf("%s: %v", v.label(), err)
	}
}

// events returns the QMP events read so far.
func (v *vm) events() []qmpEvent {
	q := v.qmp()
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]qmpEvent(nil), q.events...)
}

// runState is query-status's "status" (running, paused, postmigrate, inmigrate, ...).
func (v *vm) runState() string {
	v.t.Helper()
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(v.qmpExec("query-status", nil), &st); err != nil {
		v.t.Fatal(err)
	}
	return st.Status
}

func (v *vm) label() string {
	if v.name != "" {
		return "QEMU " + v.name
	}
	return "QEMU"
}

// ---------------------------------------------------------------------------
// Live migration (QEMU 10: two QEMUs, each with its own daemon, one started
// with vmConfig.Incoming)

// migrateOptions tune a migration; zero values take the defaults.
type migrateOptions struct {
	// DowntimeLimit is the pause QEMU may take to switch over. TCG guests
	// under fio dirty memory fast: the default (2 s) lets them converge.
	DowntimeLimit time.Duration
	// MaxBandwidth caps the transfer, bytes/s (default 4 GiB/s: no cap over
	// a unix socket; the cancel scenario sets it low to keep it running).
	MaxBandwidth int64
	// Timeout: polling query-migrate gives up (fails the test) after it
	// (default 120 s).
	Timeout time.Duration
}

const (
	defaultDowntimeLimit    = 2 * time.Second
	defaultMaxBandwidth     = 4 << 30
	defaultMigrationTimeout = 120 * time.Second
)

// migrationInfo is the part of query-migrate the tests report.
type migrationInfo struct {
	Status    string
	TotalTime time.Duration // from migrate to completion
	Downtime  time.Duration // the guest's pause at switch-over
	SetupTime time.Duration
	ErrorDesc string
	RAM       migrationRAM
	Raw       string // the last query-migrate answer
	// Timeline: both QEMUs' QMP events during the migration
	// (migrationTimeline; set by migrate).
	Timeline string
}

// migrationRAM is query-migrate's "ram" (sizes in bytes, counts in pages).
type migrationRAM struct {
	Transferred    int64   `json:"transferred"`
	Total          int64   `json:"total"`
	Duplicate      int64   `json:"duplicate"`
	Normal         int64   `json:"normal"`
	DirtySyncCount int64   `json:"dirty-sync-count"`
	Mbps           float64 `json:"mbps"`
}

// String is an `info migrate`-style summary.
func (m migrationInfo) String() string {
	s := fmt.Sprintf("status %s, total time %d ms, downtime %d ms, setup %d ms, ram transferred %.1f MiB of %.0f MiB (%d normal + %d zero pages), %d dirty syncs, %.0f Mbps",
		m.Status, m.TotalTime.Milliseconds(), m.Downtime.Milliseconds(), m.SetupTime.Milliseconds(),
		float64(m.RAM.Transferred)/(1<<20), float64(m.RAM.Total)/(1<<20), m.RAM.Normal, m.RAM.Duplicate,
		m.RAM.DirtySyncCount, m.RAM.Mbps)
	if m.ErrorDesc != "" {
		s += ", error: " + m.ErrorDesc
	}
	return s
}

// queryMigrate parses one query-migrate answer.
func (v *vm) queryMigrate() migrationInfo {
	v.t.Helper()
	raw := v.qmpExec("query-migrate", nil)
	var r struct {
		Status    string       `json:"status"`
		TotalTime int64        `json:"total-time"`
		Downtime  int64        `json:"downtime"`
		SetupTime int64        `json:"setup-time"`
		ErrorDesc string       `json:"error-desc"`
		RAM       migrationRAM `json:"ram"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		v.t.Fatalf("query-migrate: %v: %s", err, raw)
	}
	m := migrationInfo{Status: r.Status, TotalTime: time.Duration(r.TotalTime) * time.Millisecond,
		Downtime: time.Duration(r.Downtime) * time.Millisecond, SetupTime: time.Duration(r.SetupTime) * time.Millisecond,
		ErrorDesc: r.ErrorDesc, RAM: r.RAM, Raw: string(raw)}
	return m
}

// prepareMigration turns the return-path capability on in both QEMUs (so a
// destination that fails to load tells the source, which then resumes) and
// the events capability (MIGRATION events: migrationTimeline), and sets the
// source's downtime limit and bandwidth.
func prepareMigration(src, dst *vm, o migrateOptions) {
	caps := map[string]any{"capabilities": []map[string]any{
		{"capability": "return-path", "state": true}, {"capability": "events", "state": true}}}
	dst.qmpExec("migrate-set-capabilities", caps)
	src.qmpExec("migrate-set-capabilities", caps)
	src.setMigrationSpeed(o)
}

// setMigrationSpeed sets downtime-limit and max-bandwidth (also while a
// migration runs).
func (v *vm) setMigrationSpeed(o migrateOptions) {
	v.t.Helper()
	if o.DowntimeLimit == 0 {
		o.DowntimeLimit = defaultDowntimeLimit
	}
	if o.MaxBandwidth == 0 {
		o.MaxBandwidth = defaultMaxBandwidth
	}
	v.qmpExec("migrate-set-parameters", map[string]any{
		"downtime-limit": o.DowntimeLimit.Milliseconds(), "max-bandwidth": o.MaxBandwidth})
}

// startMigration sends migrate to unix:uri; an error answer (e.g. a back
// end without LOG_SHMFD: "Migration disabled: ...") is returned.
func (v *vm) startMigration(uri string) error {
	v.t.Helper()
	_, err := v.qmpTry("migrate", map[string]any{"uri": "unix:" + uri})
	return err
}

// waitMigration polls query-migrate until the status is completed, failed
// or cancelled; it fails the test after timeout (default 120 s).
func (v *vm) waitMigration(timeout time.Duration) migrationInfo {
	v.t.Helper()
	if timeout == 0 {
		timeout = defaultMigrationTimeout
	}
	deadline := time.Now().Add(timeout)
	for {
		m := v.queryMigrate()
		switch m.Status {
		case "completed", "failed", "cancelled":
			return m
		}
		if time.Now().After(deadline) {
			v.t.Fatalf("migration still %q after %v: %s", m.Status, timeout, m)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// migrationTimeline lists the QMP events of both QEMUs since from (STOP,
// RESUME, MIGRATION status changes, ...) in time order, as offsets from
// from: where a migration's time and downtime went.
func migrationTimeline(from time.Time, vms ...*vm) string {
	type ev struct {
		at   time.Time
		what string
	}
	var evs []ev
	for _, v := range vms {
		for _, e := range v.events() {
			if e.At.Before(from) {
				continue
			}
			what := e.Event
			if e.Event == "MIGRATION" {
				var d struct {
					Status string `json:"status"`
				}
				_ = json.Unmarshal(e.Data, &d)
				what += "(" + d.Status + ")"
			}
			evs = append(evs, ev{e.At, v.name + ":" + what})
		}
	}
	slices.SortStableFunc(evs, func(a, b ev) int { return a.at.Compare(b.at) })
	parts := make([]string, len(evs))
	for i, e := range evs {
		parts[i] = fmt.Sprintf("%+dms %s", e.at.Sub(from).Milliseconds(), e.what)
	}
	return strings.Join(parts, ", ")
}

// cancelMigration sends migrate_cancel.
func (v *vm) cancelMigration() {
	v.t.Helper()
	v.qmpExec("migrate_cancel", nil)
}

// migrate moves src's guest to dst (a QEMU started with Incoming = uri):
// prepareMigration, migrate, then waitMigration. A refused migrate command
// comes back as status "refused" with the error in ErrorDesc.
func migrate(src, dst *vm, uri string, o migrateOptions) migrationInfo {
	src.t.Helper()
	prepareMigration(src, dst, o)
	start := time.Now()
	if err := src.startMigration(uri); err != nil {
		return migrationInfo{Status: "refused", ErrorDesc: err.Error()}
	}
	m := src.waitMigration(o.Timeout)
	// Collect the destination's events (it may have exited: a failed load).
	_, _ = dst.qmpTry("query-status", nil)
	m.Timeline = migrationTimeline(start.Add(-time.Second), src, dst)
	return m
}

// ---------------------------------------------------------------------------
// QEMU trace logs (vmConfig.Trace)

// qemuTraceEvent is one line of a QEMU trace log: with -msg timestamp=on
// the log backend writes "PID@SEC.USEC:NAME ARGS".
type qemuTraceEvent struct {
	At         time.Time
	Name, Args string
}

// qemu11TraceNames: trace events QEMU 11 renamed (old name: QEMU 11's).
var qemu11TraceNames = map[string]string{
	"vhost_dev_start": "vhost_dev_start_in",
	"vhost_dev_stop":  "vhost_dev_stop_in",
}

// reTraceLine is QEMU 7.2 and 10's log trace line (PID@SECONDS.USEC:NAME
// ARGS); reTraceLineISO is QEMU 11's (-msg timestamp=on: an RFC 3339 UTC
// time, a space, NAME ARGS).
var (
	reTraceLine    = regexp.MustCompile(`^\d+@(\d+)\.(\d{6}):(\S+) ?(.*)$`)
	reTraceLineISO = regexp.MustCompile(`^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z) (\S+) ?(.*)$`)
)

// readQEMUTrace parses a trace log; lines without a timestamp are skipped.
func readQEMUTrace(t *testing.T, path string) []qemuTraceEvent {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []qemuTraceEvent
	for _, l := range strings.Split(string(data), "\n") {
		m := reTraceLine.FindStringSubmatch(l)
		if m == nil {
			if m := reTraceLineISO.FindStringSubmatch(l); m != nil {
				if at, err := time.Parse(time.RFC3339Nano, m[1]); err == nil {
					name := m[2]
					for old, n := range qemu11TraceNames {
						if name == n {
							name = old
						}
					}
					out = append(out, qemuTraceEvent{At: at, Name: name, Args: m[3]})
				}
			}
			continue
		}
		sec, _ := strconv.ParseInt(m[1], 10, 64)
		usec, _ := strconv.ParseInt(m[2], 10, 64)
		out = append(out, qemuTraceEvent{At: time.Unix(sec, usec*1000), Name: m[3], Args: m[4]})
	}
	return out
}

// vhostRequestNames: vhost-user request ids (DESIGN.md §2).
var vhostRequestNames = map[int]string{
	1: "GET_FEATURES", 2: "SET_FEATURES", 3: "SET_OWNER", 4: "RESET_OWNER", 5: "SET_MEM_TABLE",
	6: "SET_LOG_BASE", 7: "SET_LOG_FD", 8: "SET_VRING_NUM", 9: "SET_VRING_ADDR", 10: "SET_VRING_BASE",
	11: "GET_VRING_BASE", 12: "SET_VRING_KICK", 13: "SET_VRING_CALL", 14: "SET_VRING_ERR",
	15: "GET_PROTOCOL_FEATURES", 16: "SET_PROTOCOL_FEATURES", 17: "GET_QUEUE_NUM", 18: "SET_VRING_ENABLE",
	21: "SET_BACKEND_REQ_FD", 24: "GET_CONFIG", 25: "SET_CONFIG", 31: "GET_INFLIGHT_FD", 32: "SET_INFLIGHT_FD",
	34: "RESET_DEVICE", 36: "GET_MAX_MEM_SLOTS", 37: "ADD_MEM_REG", 38: "REM_MEM_REG", 39: "SET_STATUS",
	40: "GET_STATUS", 42: "SET_DEVICE_STATE_FD", 43: "CHECK_DEVICE_STATE",
}

var reTraceReq = regexp.MustCompile(`req:(\d+)`)

// vhostTraceNames turns the trace events in [from, to) (zero to: no end)
// into the vhost-user requests QEMU wrote, in order, with the device's
// start and stop, the VM's stop for migration and the vhost-user-fs
// section's save and load marked in brackets.
func vhostTraceNames(evs []qemuTraceEvent, from, to time.Time) []string {
	var out []string
	for _, e := range evs {
		if e.At.Before(from) || (!to.IsZero() && !e.At.Before(to)) {
			continue
		}
		switch {
		case e.Name == "vhost_user_write":
			if m := reTraceReq.FindStringSubmatch(e.Args); m != nil {
				id, _ := strconv.Atoi(m[1])
				name := vhostRequestNames[id]
				if name == "" {
					name = "REQ_" + m[1]
				}
				out = append(out, name)
			}
		case e.Name == "vhost_dev_start":
			out = append(out, "[dev-start]")
		case e.Name == "vhost_dev_stop":
			out = append(out, "[dev-stop]")
		case e.Name == "migration_completion_vm_stop":
			out = append(out, "[vm-stopped]")
		case e.Name == "vmstate_save" && strings.Contains(e.Args, "vhost-user-fs"):
			out = append(out, "[save-fs]")
		case e.Name == "qemu_loadvm_state_section_startfull" && strings.Contains(e.Args, "vhost-user-fs"):
			out = append(out, "[load-fs]")
		}
	}
	return out
}

// traceSpan is the time from the first event named first whose args
// contain firstSub to the next event named last whose args contain lastSub
// (both at or after from); 0 if either is absent.
func traceSpan(evs []qemuTraceEvent, from time.Time, first, firstSub, last, lastSub string) time.Duration {
	var start time.Time
	for _, e := range evs {
		if e.At.Before(from) {
			continue
		}
		if start.IsZero() {
			if e.Name == first && strings.Contains(e.Args, firstSub) {
				start = e.At
			}
			continue
		}
		if e.Name == last && strings.Contains(e.Args, lastSub) {
			return e.At.Sub(start)
		}
	}
	return 0
}

// ---------------------------------------------------------------------------
// The guest's console across QEMUs

// guestConsole is one guest's serial console over the QEMUs that ran it in
// turn: after a migration its output continues on the destination QEMU's
// stdout, and the answers to e2e_ask go to the destination's stdin. A line
// cut at the switch-over (the source's last line without its newline) is
// joined to the destination's first.
type guestConsole struct {
	t   *testing.T
	mu  sync.Mutex
	vms []*vm
}

func newGuestConsole(t *testing.T, first *vm) *guestConsole {
	return &guestConsole{t: t, vms: []*vm{first}}
}

// moveTo makes v (a migration's destination) the QEMU the guest now runs in.
func (c *guestConsole) moveTo(v *vm) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.vms = append(c.vms, v)
}

// current is the QEMU the guest runs in.
func (c *guestConsole) current() *vm {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.vms[len(c.vms)-1]
}

// lines returns the console lines of every QEMU in turn.
func (c *guestConsole) lines() []string {
	c.mu.Lock()
	vms := append([]*vm(nil), c.vms...)
	c.mu.Unlock()
	var out []string
	joinNext := false
	for _, v := range vms {
		v.mu.Lock()
		ls, partial := append([]string(nil), v.lines...), v.partial
		v.mu.Unlock()
		if joinNext && len(ls) > 0 && len(out) > 0 {
			out[len(out)-1] += ls[0]
			ls = ls[1:]
		}
		out = append(out, ls...)
		joinNext = partial
	}
	return out
}

// waitConsole waits until the n-th (1-based) line matching re appears on
// the console so far; it fails the test if the current QEMU exits or the
// timeout passes first.
func (c *guestConsole) waitConsole(re *regexp.Regexp, n int, timeout time.Duration) string {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		v := c.current()
		seen := 0
		for _, l := range c.lines() {
			if re.MatchString(l) {
				if seen++; seen == n {
					return l
				}
			}
		}
		if !v.Running() {
			time.Sleep(100 * time.Millisecond) // let the reader drain
			if countMatches(c.lines(), re) >= n {
				continue
			}
			if c.current() != v {
				continue
			}
			c.t.Fatalf("%s exited (%v; timed out: %v) before console line #%d matching %q\n%s",
				v.label(), v.Err(), v.timedOut.Load(), n, re, lastLines(c.lines(), 25))
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("no console line #%d matching %q within %v\n%s", n, re, timeout, lastLines(c.lines(), 25))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// answer writes one line to the console of the QEMU the guest runs in.
func (c *guestConsole) answer(s string) { c.current().answer(s) }

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
