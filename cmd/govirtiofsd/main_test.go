package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
)

// The tests below run the daemon as a process: the test binary is the
// daemon when GOVIRTIOFSD_TEST_MAIN=1.
func TestMain(m *testing.M) {
	if os.Getenv("GOVIRTIOFSD_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// syncBuffer collects a process's output while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func (b *syncBuffer) Len() int { return len(b.String()) }

// daemonCmd runs the test binary as the daemon. It is dynamically linked
// (and built with -race): it cannot re-execute itself inside a new root,
// and makes system calls outside the allowlist, so it runs unconfined.
// The sandboxed combinations (--syslog, --daemonize and the sockets under
// the default sandbox) run from test/e2e and test/integration, with the
// static binary.
func daemonCmd(args ...string) *exec.Cmd {
	return launch.Spec{Bin: os.Args[0], Args: append([]string{"--sandbox=none", "--seccomp=none"}, args...),
		Env: []string{"GOVIRTIOFSD_TEST_MAIN=1"}}.Command()
}

// startDaemon starts cmd with its stderr in stderr and waits for sock to
// appear; the daemon is killed at the end of the test.
func startDaemon(t *testing.T, cmd *exec.Cmd, sock string, stderr *syncBuffer) *launch.Process {
	t.Helper()
	cmd.Stderr = stderr
	p, err := launch.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	if err := p.WaitSocket(sock, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestPrintCapabilities(t *testing.T) {
	out, err := daemonCmd("--print-capabilities").Output()
	if err != nil {
		t.Fatal(err)
	}
	var caps struct {
		Type     string   `json:"type"`
		Features []string `json:"features"`
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&caps); err != nil {
		t.Fatalf("not the capabilities JSON: %v\n%s", err, out)
	}
	// As the Rust virtiofsd 1.14 prints them.
	want := []string{"migrate-precopy", "posix-acl-negotiation-mode", "security-label-negotiation-mode", "separate-options"}
	if caps.Type != "fs" || !slices.Equal(caps.Features, want) {
		t.Errorf("capabilities %+v, want type fs with exactly %q", caps, want)
	}
	// A DAX window rules migration out.
	out, err = daemonCmd("--print-capabilities", "--cache-size", "64M").Output()
	if err != nil {
		t.Fatal(err)
	}
	caps.Features = nil
	if err := json.Unmarshal(out, &caps); err != nil {
		t.Fatalf("not the capabilities JSON: %v\n%s", err, out)
	}
	if !slices.Equal(caps.Features, want[1:]) {
		t.Errorf("capabilities with --cache-size %q, want %q", caps.Features, want[1:])
	}
}

func TestUnknownOptionExits1(t *testing.T) {
	for _, args := range [][]string{{"--bogus"}, {"-o", "source=/tmp,bogus"}, {"--shared-dir=/tmp"}} {
		var stderr syncBuffer
		cmd := daemonCmd(args...)
		cmd.Stderr = &stderr
		err := cmd.Run()
		if cmd.ProcessState.ExitCode() != 1 || !strings.HasPrefix(stderr.String(), "govirtiofsd: ") {
			t.Errorf("%q: exit %v, stderr %q; want exit 1 with a message", args, err, stderr.String())
		}
	}
}

// TestSocketPathLifecycle: the socket is 0600 and locked by <socket>.pid
// holding the daemon's pid; a second daemon on it is refused; SIGTERM
// removes both.
func TestSocketPathLifecycle(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "v.sock")
	var stderr syncBuffer
	first := startDaemon(t, daemonCmd("--socket-path", sock, "--shared-dir", dir, "--allow-mmap"), sock, &stderr)
	if st, err := os.Stat(sock); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v (%v), want 0600", st.Mode(), err)
	}
	pid, err := os.ReadFile(sock + ".pid")
	if err != nil || strings.TrimSpace(string(pid)) != strconv.Itoa(first.Pid()) {
		t.Errorf("pid file holds %q (%v), want %d", pid, err, first.Pid())
	}

	var stderr2 syncBuffer
	second := daemonCmd("--socket-path", sock, "--shared-dir", dir)
	second.Stderr = &stderr2
	err = second.Run()
	if second.ProcessState.ExitCode() != 1 || !strings.Contains(stderr2.String(), "another daemon (pid "+strconv.Itoa(first.Pid())+") is serving") {
		t.Errorf("second daemon: %v, stderr %q; want exit 1, refused", err, stderr2.String())
	}
	if _, err := os.Stat(sock); err != nil {
		t.Errorf("the second daemon took the socket: %v", err)
	}

	first.Signal(syscall.SIGTERM)
	<-first.Done()
	if err := first.Err(); err != nil {
		t.Errorf("SIGTERM: exit %v, want 0", err)
	}
	for _, p := range []string{sock, sock + ".pid"} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind (%v)", p, err)
		}
	}
	if !strings.Contains(stderr.String(), "--allow-mmap has no effect") {
		t.Errorf("no note for --allow-mmap in the log:\n%s", stderr.String())
	}
}

func TestSocketGroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown to another group needs root")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "v.sock")
	var stderr syncBuffer
	startDaemon(t, daemonCmd("--socket-path", sock, "--shared-dir", dir, "--socket-group=4242"), sock, &stderr)
	// The socket appears at listen(2); its group is set right after, so
	// a loaded machine can show the test the socket before the chown.
	var st syscall.Stat_t
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if err := syscall.Stat(sock, &st); err != nil {
			t.Fatal(err)
		}
		if st.Gid == 4242 || time.Now().After(deadline) {
			break
		}
	}
	if st.Gid != 4242 || st.Mode&0o777 != 0o660 {
		t.Errorf("socket group %d mode %o, want 4242 and 0660", st.Gid, st.Mode&0o777)
	}
}

// TestSyslog: with --syslog the daemon sends RFC 3164 lines with the
// daemon facility to the syslog socket (here the test's, through
// GOVIRTIOFSD_SYSLOG_SOCKET), and the debug lines at LOG_DEBUG.
func TestSyslog(t *testing.T) {
	dir := t.TempDir()
	logSock := filepath.Join(dir, "log")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: logSock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sock := filepath.Join(dir, "v.sock")
	cmd := daemonCmd("--syslog", "--socket-path", sock, "--shared-dir", dir, "-d", "--allow-mmap")
	cmd.Env = append(cmd.Env, "GOVIRTIOFSD_SYSLOG_SOCKET="+logSock)
	var stderr syncBuffer
	cmd.Stderr = &stderr
	p, err := launch.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	re := regexp.MustCompile(`^<(\d+)>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d govirtiofsd\.test\[` + strconv.Itoa(p.Pid()) + `\]: msg="([^"]*)"`)
	// Read until the start-up lines and a debug line have arrived; once
	// the daemon waits, a vhost-user GET_FEATURES gives a debug line.
	var note, waiting, debug int
	buf := make([]byte, 4096)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for note == 0 || waiting == 0 || debug == 0 {
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("note %d waiting %d debug %d: %v (daemon stderr %q)", note, waiting, debug, err, stderr.String())
		}
		m := re.FindSubmatch(buf[:n])
		if m == nil {
			t.Fatalf("syslog line %q is not <PRI>Mmm dd hh:mm:ss ident[pid]: msg=...", buf[:n])
		}
		pri, _ := strconv.Atoi(string(m[1]))
		switch msg := string(m[2]); {
		case pri == 3<<3|7:
			debug = pri
		case strings.HasPrefix(msg, "--allow-mmap"):
			note = pri
		case msg == "waiting for vhost-user connection":
			waiting = pri
			conn, err := net.Dial("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.Write([]byte{1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}) // GET_FEATURES, version 1
		}
	}
	if note != 3<<3|6 || waiting != 3<<3|6 {
		t.Errorf("priorities %d, %d; want daemon.info (30)", note, waiting)
	}
	if stderr.Len() != 0 {
		t.Errorf("logged to stderr too: %q", stderr.String())
	}
}

// TestSIGTERMAsSoonAsTheSocketExists: a front end (or systemd) may stop the
// daemon the moment its socket appears; the daemon must still exit 0 and
// remove the socket and its pid file, not die of the signal's default
// action with both left behind.
func TestSIGTERMAsSoonAsTheSocketExists(t *testing.T) {
	for i := range 10 {
		dir := t.TempDir()
		sock := filepath.Join(dir, "v.sock")
		d, err := launch.Start(daemonCmd("--socket-path", sock, "--shared-dir", dir))
		if err != nil {
			t.Fatal(err)
		}
		if err := d.WaitCreated(sock, 10*time.Second); err != nil {
			d.Kill()
			t.Fatalf("run %d: %v", i, err)
		}
		d.Signal(syscall.SIGTERM)
		<-d.Done()
		if err := d.Err(); err != nil {
			t.Errorf("run %d: SIGTERM at once: exit %v, want 0", i, err)
		}
		for _, p := range []string{sock, sock + ".pid"} {
			if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("run %d: %s left behind (%v)", i, p, err)
			}
		}
	}
}

// TestSyslogUnreachable: with no syslog socket the daemon says so and logs
// to stderr instead of failing (Kata passes --syslog everywhere).
func TestSyslogUnreachable(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "v.sock")
	cmd := daemonCmd("--syslog", "--socket-path", sock, "--shared-dir", dir)
	cmd.Env = append(cmd.Env, "GOVIRTIOFSD_SYSLOG_SOCKET="+filepath.Join(dir, "nothing"))
	var stderr syncBuffer
	startDaemon(t, cmd, sock, &stderr)
	// The socket exists before the daemon is ready to serve it.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if strings.Contains(stderr.String(), "waiting for vhost-user connection") {
			break
		}
	}
	if !strings.Contains(stderr.String(), "logging to stderr") || !strings.Contains(stderr.String(), "waiting for vhost-user connection") {
		t.Errorf("stderr %q", stderr.String())
	}
}

// TestDaemonize: the command returns 0 once the socket listens; the
// daemon runs on in its own session, holds the pid file, and removes the
// socket when terminated.
func TestDaemonize(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "v.sock")
	cmd := daemonCmd("--daemonize", "--socket-path", sock, "--shared-dir", dir)
	var stderr syncBuffer
	cmd.Stderr = &stderr
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("--daemonize: %v\n%s", err, stderr.String())
	}
	t.Logf("--daemonize returned after %v", time.Since(start))
	if st, err := os.Stat(sock); err != nil || st.Mode()&os.ModeSocket == 0 {
		t.Fatalf("no socket when --daemonize returned: %v", err)
	}
	b, err := os.ReadFile(sock + ".pid")
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 || pid == cmd.Process.Pid {
		t.Fatalf("pid file %q (%v): want the background daemon's pid", b, err)
	}
	defer syscall.Kill(pid, syscall.SIGKILL)
	if sid, _ := syscall.Getpgid(pid); sid != pid {
		t.Errorf("background daemon %d is in process group %d, want its own session", pid, sid)
	}
	// It serves: a connection is accepted (the socket is then removed).
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	conn.Close()
	syscall.Kill(pid, syscall.SIGTERM)
	for deadline := time.Now().Add(5 * time.Second); syscall.Kill(pid, 0) == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("background daemon still running 5 s after SIGTERM")
		}
	}
	for _, p := range []string{sock, sock + ".pid"} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind (%v)", p, err)
		}
	}
}

// TestDaemonizeFailure: a daemon that cannot start makes --daemonize fail.
func TestDaemonizeFailure(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "v.sock")
	cmd := daemonCmd("--daemonize", "--socket-path", sock, "--shared-dir", dir, "--xattrmap", ":bogus:")
	var stderr syncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); cmd.ProcessState.ExitCode() != 1 {
		t.Fatalf("exit %v, want 1\n%s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "background daemon failed") {
		t.Errorf("stderr %q", stderr.String())
	}
}
