package integration

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// daemonBin is the daemon under test: by default the race-enabled build
// made by TestMain, run with --sandbox none --seccomp none (a race build is
// dynamic, and the race runtime makes system calls outside the allowlist);
// with GOVIRTIOFSD_INTEGRATION_BIN the static daemon (make build) in the
// sandbox GOVIRTIOFSD_INTEGRATION_SANDBOX (namespace, the default, chroot
// or none) with the default --seccomp kill.
var daemonBin string

// testTmp is a directory for the whole run.
var testTmp string

// sandboxMode is the static daemon's --sandbox, "" for the race build.
var sandboxMode string

// sandboxArgs are the daemon's sandbox options for this run.
func sandboxArgs() []string {
	if sandboxMode == "" {
		return []string{"--sandbox", "none", "--seccomp", "none"}
	}
	return []string{"--sandbox", sandboxMode}
}

// exitTimeout is how long the daemon may take to exit after the front end
// disconnects: a second for the static daemon, as the hostile-peers issue
// asks; two for the race build (its exit-time report takes part of it).
var exitTimeout = 2 * time.Second

// opTimeout bounds replies and completions: generous, the machine is shared.
const opTimeout = 20 * time.Second

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Println("integration: skipping, the daemon's passthrough file system needs root")
		os.Exit(0)
	}
	code, err := buildAndRun(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func buildAndRun(m *testing.M) (int, error) {
	tmp, err := os.MkdirTemp("", "govirtiofsd-integration-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(tmp)
	testTmp = tmp
	if err := checkShareKind(); err != nil {
		return 0, err
	}
	if bin := os.Getenv("GOVIRTIOFSD_INTEGRATION_BIN"); bin != "" {
		if daemonBin, err = launch.Existing(bin); err != nil {
			return 0, fmt.Errorf("GOVIRTIOFSD_INTEGRATION_BIN: %w", err)
		}
		exitTimeout = time.Second
		sandboxMode = os.Getenv("GOVIRTIOFSD_INTEGRATION_SANDBOX")
		switch sandboxMode {
		case "":
			sandboxMode = "namespace"
		case "namespace", "chroot", "none":
		default:
			return 0, fmt.Errorf("GOVIRTIOFSD_INTEGRATION_SANDBOX=%q: want namespace, chroot or none", sandboxMode)
		}
		fmt.Printf("integration: %s with --sandbox %s --seccomp kill\n", daemonBin, sandboxMode)
		return m.Run(), nil
	}
	daemonBin = filepath.Join(tmp, "govirtiofsd")
	if err := (launch.Build{Race: true, Repo: repoTop, Out: daemonBin}).Run(); err != nil {
		return 0, err
	}
	return m.Run(), nil
}

// repoTop is the repository's top directory, from this package's.
var repoTop = filepath.Join("..", "..")

// daemon is one govirtiofsd process serving one connection.
type daemon struct {
	*launch.Process
	t    *testing.T
	sock string
	dir  string // the shared directory

	// allowExit1 accepts exit status 1 (a stream the daemon had to give
	// up on) as well as 0.
	allowExit1 bool
	// expectSIGSYS wants the sandboxed daemon killed by seccomp: the
	// supervisor's status 128+SIGSYS and its report in the log.
	expectSIGSYS bool

	mu       sync.Mutex
	devs     []*vmm.Device
	finished bool
}

// startDaemon runs govirtiofsd on a fresh shared directory with the given
// extra arguments, and registers the end-of-test checks.
func startDaemon(t *testing.T, extra ...string) *daemon {
	t.Helper()
	return startDaemonCred(t, nil, extra...)
}

// startDaemonCred is startDaemon with the daemon's credentials (nil: ours).
func startDaemonCred(t *testing.T, cred *syscall.Credential, extra ...string) *daemon {
	t.Helper()
	return startDaemonWith(t, daemonSpec{cred: cred}, extra...)
}

// daemonSpec is how startDaemonWith starts the daemon.
type daemonSpec struct {
	bin  string              // "" is daemonBin
	env  []string            // added to ours
	cred *syscall.Credential // nil: ours
	// files are inherited from fd 3 on (as if leaked by whoever
	// started the daemon).
	files []*os.File
	// share is the shared directory, "" for a fresh one (a migration's
	// destination shares its source's).
	share string
}

// startDaemonWith is startDaemon as spec says. A daemon with another uid
// gets the share and the socket's directory, and a path to them.
func startDaemonWith(t *testing.T, spec daemonSpec, extra ...string) *daemon {
	t.Helper()
	bin := spec.bin
	if bin == "" {
		bin = daemonBin
	}
	sockDir, err := os.MkdirTemp("", "gvfs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	tmp := t.TempDir()
	d := &daemon{t: t, sock: filepath.Join(sockDir, "vhost.sock"), dir: spec.share}
	if d.dir == "" {
		d.dir = makeShare(t, tmp)
	}
	if c := spec.cred; c != nil && c.Uid != 0 {
		for _, p := range []string{filepath.Dir(tmp), tmp, filepath.Dir(d.dir)} {
			if err := os.Chmod(p, 0o711); err != nil {
				t.Fatal(err)
			}
		}
		for _, p := range []string{d.dir, sockDir} {
			if err := os.Chown(p, int(c.Uid), int(c.Gid)); err != nil {
				t.Fatal(err)
			}
		}
	}
	args := append(append(append([]string{"--log-level", "debug"}, sandboxArgs()...), shareArgs()...), extra...)
	p, err := launch.Spec{Bin: bin, Args: launch.Line{Kind: launch.Ours, Socket: d.sock, Share: d.dir, Extra: args}.Args(),
		// Keep the race runtime's exit pause short: the daemon must be
		// gone within exitTimeout.
		Env:  append([]string{"GORACE=" + strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=100")}, spec.env...),
		Cred: spec.cred, Files: spec.files, Log: filepath.Join(tmp, "daemon.log")}.Start()
	if err != nil {
		t.Fatal(err)
	}
	d.Process = p
	t.Cleanup(d.finish)
	return d
}

// pid is the id of the process that serves: the supervisor's child in a
// namespace or chroot sandbox (call it once the daemon has answered).
//
// A child is listed in the children file of the thread that forked it,
// any of the supervisor's threads: all of them are read.
func (d *daemon) pid() int {
	p := d.Pid()
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", p))
	var kids []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil {
			kids = append(kids, strings.Fields(string(b))...)
		}
	}
	if len(kids) == 1 {
		if c, err := strconv.Atoi(kids[0]); err == nil {
			return c
		}
	}
	return p
}

// daemonPath is how the serving process names the host path p of the
// share in its fd links: relative to the share in a namespace sandbox.
func (d *daemon) daemonPath(p string) string {
	if d.pid() == d.Pid() || sandboxMode != "namespace" {
		return p
	}
	if p == d.dir {
		return "/"
	}
	return strings.TrimPrefix(p, d.dir)
}

// connect starts a device on the daemon (the QEMU 7.2 start-up flow). The
// flow ends with SET_VRING_CALLs that carry fds and get no reply; a
// GET_FEATURES round trip after it means the message loop has handled
// them, so a test's fd count never catches a new call fd before the close
// of the one it replaces.
func (d *daemon) connect(opts vmm.Options) *vmm.Device {
	d.t.Helper()
	dev, err := vmm.Start(d.sock, withRings(opts))
	if err != nil {
		d.t.Fatalf("vmm start: %v", err)
	}
	d.track(dev)
	if _, err := dev.Conn.GetFeatures(); err != nil {
		d.t.Fatalf("GET_FEATURES after start-up: %v", err)
	}
	return dev
}

// dial connects without sending anything.
func (d *daemon) dial(opts vmm.Options) *vmm.Device {
	d.t.Helper()
	dev, err := vmm.Connect(d.sock, withRings(opts))
	if err != nil {
		d.t.Fatalf("vmm connect: %v", err)
	}
	d.track(dev)
	return dev
}

func (d *daemon) track(dev *vmm.Device) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.devs = append(d.devs, dev)
}

// disconnect closes every device (the front end goes away) and checks that
// the daemon exits cleanly and promptly.
func (d *daemon) disconnect() {
	d.t.Helper()
	d.mu.Lock()
	devs := d.devs
	d.mu.Unlock()
	for _, dev := range devs {
		dev.Close()
	}
	d.checkExit(time.Now())
}

// abort drops the front end's socket the way a killed QEMU does: a plain
// close, no shutdown first (vmm's Conn.Close shuts down first). The fd
// number is pointed at /dev/null so that the Conn can still be closed
// later without touching a reused fd.
func abort(t *testing.T, c *vmm.Conn) {
	t.Helper()
	null, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(null)
	if err := unix.Dup3(null, c.Fd(), unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
}

// checkExit waits for the daemon to exit after a disconnect at since.
func (d *daemon) checkExit(since time.Time) {
	d.t.Helper()
	d.mu.Lock()
	if d.finished {
		d.mu.Unlock()
		return
	}
	d.finished = true
	d.mu.Unlock()
	if !d.Wait(exitTimeout - time.Since(since)) {
		d.t.Errorf("daemon still running %v after the front end disconnected", exitTimeout)
		// SIGQUIT: a goroutine dump into the log.
		d.Stop(10*time.Second, launch.Step{Signal: syscall.SIGQUIT, Wait: 5 * time.Second})
	}
	code := d.Status().Code
	log := d.Log()
	if d.expectSIGSYS {
		if code != 128+int(syscall.SIGSYS) || !strings.Contains(log, "killed by signal SIGSYS") {
			d.t.Errorf("daemon exited with %v, want a seccomp kill (status %d and the supervisor's report)", d.Err(), 128+int(syscall.SIGSYS))
		}
		return
	}
	switch {
	case code == 0:
	case code == 1 && d.allowExit1:
	case code == 66:
		d.t.Errorf("daemon exited with status 66: data race")
	default:
		d.t.Errorf("daemon exited with %v", d.Err())
	}
	for _, bad := range []string{"WARNING: DATA RACE", "panic:", "fatal error:", "SIGBUS", "SIGSEGV", "SIGSYS", "killed by signal"} {
		if strings.Contains(log, bad) {
			d.t.Errorf("daemon log contains %q", bad)
		}
	}
}

// finish is the end-of-test check, run as a cleanup.
func (d *daemon) finish() {
	d.disconnect()
	switch {
	case os.Getenv("GOVIRTIOFSD_TEST_LOG") != "":
		d.t.Logf("daemon log:\n%s", d.Log())
	case d.t.Failed():
		d.t.Logf("daemon log (last lines of %s):\n%s", d.LogPath, d.Tail(80))
		if kept, err := d.keepLog(); err != nil {
			d.t.Logf("cannot keep the whole daemon log: %v", err)
		} else {
			d.t.Logf("whole daemon log kept as %s", kept)
		}
	}
}

// keepLog copies the daemon's log out of the test's temporary directory,
// which is removed even after a failure, into .cache/integration-logs at
// the top of the repository: a rare failure's goroutine dump (written when
// a daemon that will not exit is killed) is then still there to read.
func (d *daemon) keepLog() (string, error) {
	dir, err := filepath.Abs(filepath.Join("..", "..", ".cache", "integration-logs"))
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	name := strings.NewReplacer("/", "_", " ", "_").Replace(d.t.Name()) + "-" + time.Now().Format("20060102-150405.000") + ".log"
	path := filepath.Join(dir, name)
	return path, os.WriteFile(path, []byte(d.Log()), 0o644)
}

// logCount counts log lines containing s.
func (d *daemon) logCount(s string) int {
	n := 0
	sc := bufio.NewScanner(strings.NewReader(d.Log()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if strings.Contains(sc.Text(), s) {
			n++
		}
	}
	return n
}

// fdCount is the number of open fds of the daemon.
func (d *daemon) fdCount() int {
	d.t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", d.pid()))
	if err != nil {
		d.t.Fatalf("reading the daemon's fds: %v", err)
	}
	return len(ents)
}

// alive fails the test if the daemon has exited.
func (d *daemon) alive() {
	d.t.Helper()
	if !d.Running() {
		d.t.Fatalf("daemon exited unexpectedly: %v", d.Err())
	}
}

// hostFile reads a file of the shared directory.
func (d *daemon) hostFile(name string) []byte {
	d.t.Helper()
	b, err := os.ReadFile(filepath.Join(d.dir, name))
	if err != nil {
		d.t.Fatal(err)
	}
	return b
}

func (d *daemon) writeHostFile(name string, data []byte) {
	d.t.Helper()
	if err := os.WriteFile(filepath.Join(d.dir, name), data, 0o644); err != nil {
		d.t.Fatal(err)
	}
}

// knownBug skips a test of a known daemon bug unless GOVIRTIOFSD_KNOWN_BUGS
// is set.
func knownBug(t *testing.T, what string) {
	t.Helper()
	if os.Getenv("GOVIRTIOFSD_KNOWN_BUGS") == "" {
		t.Skip("daemon bug: " + what)
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// opts returns the default options with the integration timeout.
// packedRings: GOVIRTIOFSD_INTEGRATION_RINGS=packed runs the tests on
// packed virtqueues (make integration-sandbox runs the ring tests again so):
// every device the harness connects then requires VIRTIO_F_RING_PACKED.
var packedRings = os.Getenv("GOVIRTIOFSD_INTEGRATION_RINGS") == "packed"

// withRings adds the packed-ring requirement to o when the tests run on
// packed rings, whatever features a test chose (0 means the defaults).
func withRings(o vmm.Options) vmm.Options {
	if packedRings {
		o = requirePacked(o)
	}
	return o
}

// requirePacked makes o ask for packed rings and refuse to start without.
func requirePacked(o vmm.Options) vmm.Options {
	if o.Features == 0 {
		o.Features = vmm.DefaultFeatures
	}
	o.Features |= vmm.Bit(vmm.FRingPacked)
	o.RequireFeatures |= vmm.Bit(vmm.FRingPacked)
	return o
}

// usedAtStop is where the device of stopped ring q will write its next
// used entry, from the ring and GET_VRING_BASE's base, once it checked that
// the device had returned every chain it took: a split ring's used.idx
// equals base; a packed ring's base has its used position equal to its
// avail position (index and wrap counter).
func usedAtStop(q *vmm.Queue, base uint32) (uint32, error) {
	if q.Packed() {
		b := vmm.ParsePackedBase(base)
		if b.UsedIdx != b.AvailIdx || b.UsedWrap != b.AvailWrap {
			return 0, fmt.Errorf("GET_VRING_BASE %v: chains taken and not returned", b)
		}
		return base >> 16, nil
	}
	if u := q.UsedIdx(); uint16(base) != u {
		return 0, fmt.Errorf("GET_VRING_BASE = %d but used.idx = %d: not every request taken was pushed before the answer", base, u)
	}
	return base, nil
}

// usedNow is where the device's next used entry goes as the ring shows it
// now, in usedAtStop's terms: a split ring's used.idx; on a packed ring the
// driver's next used slot and wrap counter after collecting every used
// descriptor written (a device that wrote one more moves it).
func usedNow(q *vmm.Queue) uint32 {
	if q.Packed() {
		q.Harvest()
		i, w := q.NextUsed()
		return uint32(vmm.OffWrap(i, w))
	}
	return uint32(q.UsedIdx())
}

func opts() vmm.Options {
	o := vmm.DefaultOptions()
	o.Timeout = opTimeout
	return o
}

// ---- FUSE helpers ----

// fsc is a FUSE client on one ring.
type fsc struct {
	t *testing.T
	*vmm.Session
}

func newFS(t *testing.T, dev *vmm.Device, ring int) *fsc {
	return &fsc{t: t, Session: vmm.NewSession(dev, ring)}
}

// mount sends FUSE_INIT as Linux 6.1 does and checks the answer.
func (c *fsc) mount() *vmm.InitOut {
	c.t.Helper()
	o, err := c.Init(vmm.KernelMinor, vmm.LinuxInitFlags)
	if err != nil {
		c.t.Fatalf("FUSE_INIT on ring %d: %v", c.Queue, err)
	}
	if o.Major != 7 || o.Minor != vmm.KernelMinor {
		c.t.Fatalf("FUSE_INIT answered %d.%d, want 7.%d", o.Major, o.Minor, vmm.KernelMinor)
	}
	return o
}

func createIn(flags, mode uint32, name string) []byte {
	b := le32(nil, flags)
	b = le32(b, mode)
	b = le32(b, 0o022) // umask
	b = le32(b, 0)     // open_flags
	return append(append(b, name...), 0)
}

var le = binary.LittleEndian

func le32(b []byte, v uint32) []byte { return le.AppendUint32(b, v) }

func le64(b []byte, v uint64) []byte { return le.AppendUint64(b, v) }

// tryCreate sends CREATE and returns the node id and file handle.
func (c *fsc) tryCreate(parent uint64, name string, flags uint32) (uint64, uint64, error) {
	b, err := c.Call(vmm.OpCreate, parent, createIn(flags, 0o100644, name), nil, vmm.FuseEntryOutSize+16)
	if err != nil {
		return 0, 0, err
	}
	if len(b) != vmm.FuseEntryOutSize+16 {
		return 0, 0, fmt.Errorf("CREATE reply body of %d bytes", len(b))
	}
	e, err := vmm.ParseEntryOut(b[:vmm.FuseEntryOutSize])
	if err != nil {
		return 0, 0, err
	}
	return e.NodeID, le.Uint64(b[vmm.FuseEntryOutSize:]), nil
}

func (c *fsc) create(parent uint64, name string, flags uint32) (uint64, uint64) {
	c.t.Helper()
	n, fh, err := c.tryCreate(parent, name, flags)
	if err != nil {
		c.t.Fatalf("CREATE %s on ring %d: %v", name, c.Queue, err)
	}
	return n, fh
}

func (c *fsc) lookup(parent uint64, name string) *vmm.EntryOut {
	c.t.Helper()
	e, err := c.Lookup(parent, name)
	if err != nil {
		c.t.Fatalf("LOOKUP %s on ring %d: %v", name, c.Queue, err)
	}
	return e
}

func (c *fsc) open(node uint64, flags uint32) uint64 {
	c.t.Helper()
	fh, err := c.Open(node, flags)
	if err != nil {
		c.t.Fatalf("OPEN on ring %d: %v", c.Queue, err)
	}
	return fh
}

func (c *fsc) write(node, fh, off uint64, data []byte) {
	c.t.Helper()
	n, err := c.Write(node, fh, off, data)
	if err != nil {
		c.t.Fatalf("WRITE of %d bytes on ring %d: %v", len(data), c.Queue, err)
	}
	if int(n) != len(data) {
		c.t.Fatalf("WRITE of %d bytes on ring %d wrote %d", len(data), c.Queue, n)
	}
}

func (c *fsc) read(node, fh, off uint64, size int) []byte {
	c.t.Helper()
	b, err := c.Read(node, fh, off, uint32(size))
	if err != nil {
		c.t.Fatalf("READ of %d bytes on ring %d: %v", size, c.Queue, err)
	}
	return b
}

func (c *fsc) getattr(node uint64) *vmm.AttrOut {
	c.t.Helper()
	a, err := c.Getattr(node)
	if err != nil {
		c.t.Fatalf("GETATTR on ring %d: %v", c.Queue, err)
	}
	return a
}

// roundTrip creates name, writes data through FUSE, checks the host file,
// reads it back through FUSE and releases the handle.
func (c *fsc) roundTrip(d *daemon, name string, data []byte) {
	c.t.Helper()
	node, fh := c.create(vmm.RootID, name, syscall.O_RDWR)
	c.write(node, fh, 0, data)
	if got := d.hostFile(name); !bytes.Equal(got, data) {
		c.t.Fatalf("host file %s: %d bytes, want %d (first diff at %d)", name, len(got), len(data), firstDiff(got, data))
	}
	if got := c.read(node, fh, 0, len(data)); !bytes.Equal(got, data) {
		c.t.Fatalf("READ of %s on ring %d: %d bytes, want %d (first diff at %d)", name, c.Queue, len(got), len(data), firstDiff(got, data))
	}
	if err := c.Release(node, fh, syscall.O_RDWR); err != nil {
		c.t.Fatalf("RELEASE on ring %d: %v", c.Queue, err)
	}
}

// check makes one cheap valid request on the session's ring.
func (c *fsc) check() {
	c.t.Helper()
	c.getattr(vmm.RootID)
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// pattern is n bytes of data that differ per seed and per position.
func pattern(seed, n int) []byte {
	b := make([]byte, n)
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
	return b
}

// noViolations fails on any device misbehaviour vmm saw on the rings.
func noViolations(t *testing.T, dev *vmm.Device) {
	t.Helper()
	for _, q := range dev.Queues {
		for _, v := range q.Violations() {
			t.Errorf("ring violation: %s", v)
		}
		if s := q.Stats(); s.Lost != 0 {
			t.Errorf("ring %d: %d lost interrupts (signals on stale call fds)", q.Index, s.Lost)
		}
	}
}

// replyErr extracts the REPLY_ACK failure code of err (0 if not one).
func replyErr(err error) uint64 {
	var re *vmm.ReplyError
	if errors.As(err, &re) {
		return re.Code
	}
	return 0
}
