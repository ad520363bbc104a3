//go:build linux

package e2e

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
)

// dropInLine is one way a VMM manager launches virtiofsd, verbatim.
type dropInLine struct {
	name string
	// fd is the number the listening socket is inherited as; -1: the
	// daemon creates it with --socket-path.
	fd     int
	syslog bool // the line has --syslog: the lines must reach the syslog socket
	debug  bool // the line sets the debug level: FUSE request lines on stderr
	// comma puts a comma in the shared directory's name: libvirt
	// escapes it in -o (Kata's directories have none).
	comma bool
	args  func(shared, sock string) []string
}

// libvirtEscape writes a path as libvirt does inside -o: "," becomes ",,".
func libvirtEscape(p string) string { return strings.ReplaceAll(p, ",", ",,") }

var dropInLines = []dropInLine{
	{name: "kata", fd: 3, syslog: true, args: func(d, _ string) []string {
		return []string{"--syslog", "--cache=auto", "--shared-dir=" + d, "--fd=3", "--thread-pool-size=1", "--announce-submounts", "--xattr"}
	}},
	{name: "kata-older", fd: 3, syslog: true, args: func(d, _ string) []string {
		return []string{"--syslog", "-o", "cache=auto", "-o", "no_posix_lock", "-o", "source=" + d, "--fd=3", "-f", "--thread-pool-size=1", "-o", "announce_submounts"}
	}},
	{name: "libvirt", fd: 23, comma: true, args: func(d, _ string) []string {
		return []string{"--fd=23", "-o", "source=" + libvirtEscape(d) + ",cache=none,sandbox=chroot,xattr"}
	}},
	{name: "libvirt-separate-options", fd: 23, debug: true, comma: true, args: func(d, _ string) []string {
		return []string{"--fd=23", "--shared-dir", d, "--cache", "never", "--sandbox", "chroot", "--xattr", "--rlimit-nofile=" + strconv.FormatUint(nofileForLibvirt(), 10), "--log-level", "debug"}
	}},
	{name: "socket-path", fd: -1, args: func(d, s string) []string {
		return []string{"--socket-path=" + s, "--shared-dir=" + d}
	}},
	// The Rust virtiofsd 1.14's negotiation modes, as a manager that
	// read posix-acl- and security-label-negotiation-mode from
	// --print-capabilities passes them. The guest offers both; without
	// an LSM that labels files it sends every creation the bare
	// security-context header.
	{name: "rust-1.14-auto", fd: -1, args: func(d, s string) []string {
		return []string{"--socket-path=" + s, "--shared-dir=" + d, "--posix-acl=auto", "--security-label=auto"}
	}},
	{name: "rust-1.14-always", fd: -1, args: func(d, s string) []string {
		return []string{"--socket-path=" + s, "--shared-dir=" + d, "--posix-acl", "--security-label=always"}
	}},
}

// nofileForLibvirt is the N of libvirt's --rlimit-nofile=N (from
// <openfiles max='N'/>): 65536, or the hard limit if that is lower. The
// daemon sets soft and hard limit to exactly N, as the Rust daemon does,
// and raising the hard limit needs CAP_SYS_RESOURCE, which libvirtd has
// and a test in a container may not.
func nofileForLibvirt() uint64 {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 65536
	}
	return min(65536, rl.Max)
}

// TestDropInLaunchLines boots a guest (Linux 6.1) on the daemon started by
// each launch line of Kata Containers and libvirt verbatim, and by hand
// with --socket-path; QEMU uses Kata's device line (tag kataShared,
// queue-size 1024) and guest memory from a file in /dev/shm. The guest
// runs guest-scripts/dropin.sh; every step must succeed, the file it
// leaves must be on the host, QEMU and the daemon must exit 0, and the
// daemon's log must have arrived where the line sends it.
func TestDropInLaunchLines(t *testing.T) {
	requireE2E(t)
	k := sideBySideKernels(t)[0]
	var mu sync.Mutex
	var summary []string
	t.Cleanup(func() {
		t.Logf("launch lines on %s:\n  %s", k.Version, strings.Join(summary, "\n  "))
	})
	for _, line := range dropInLines {
		t.Run(line.name, func(t *testing.T) {
			start := time.Now()
			defer func() {
				res := "ok"
				if t.Failed() {
					res = "FAILED"
				}
				mu.Lock()
				summary = append(summary, fmt.Sprintf("%-26s %-6s %5.1fs", line.name, res, time.Since(start).Seconds()))
				mu.Unlock()
			}()
			scenarioDropIn(t, k, line)
		})
	}
}

// syslogSink is a unixgram socket standing in for /dev/log.
type syslogSink struct {
	path string
	mu   sync.Mutex
	msgs []string
}

func newSyslogSink(t *testing.T, dir string) *syslogSink {
	t.Helper()
	s := &syslogSink{path: filepath.Join(dir, "log")}
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: s.path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			s.mu.Lock()
			s.msgs = append(s.msgs, string(buf[:n]))
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *syslogSink) lines() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.msgs...)
}

func scenarioDropIn(t *testing.T, k guestKernel, line dropInLine) {
	dir := artifactDir(t)
	sockDir, err := os.MkdirTemp("", "e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	shared := filepath.Join(t.TempDir(), "share")
	if line.comma {
		shared += ",1"
	}
	if err := os.Mkdir(shared, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(shared, "hello"), []byte(helloContent), 0o644); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(sockDir, "vhost.sock")

	logPath := filepath.Join(dir, "daemon.log")
	spec := launch.Spec{Bin: ourDaemonBinary(t), Args: line.args(shared, sock), Group: true, Log: logPath, Header: true}
	var sink *syslogSink
	if line.syslog {
		sink = newSyslogSink(t, sockDir)
		t.Cleanup(func() { // kept with the other logs
			os.WriteFile(filepath.Join(dir, "syslog.log"), []byte(strings.Join(sink.lines(), "\n")+"\n"), 0o644)
		})
		spec.Env = []string{"GOVIRTIOFSD_SYSLOG_SOCKET=" + sink.path}
	}
	if line.fd >= 0 {
		// The manager binds and listens, and the daemon inherits the
		// socket as fd N (Kata: 3).
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		ln.SetUnlinkOnClose(false)
		f, err := ln.File()
		ln.Close()
		if err != nil {
			t.Fatal(err)
		}
		spec.Files = make([]*os.File, line.fd-2) // fd 3+i; nil: closed
		spec.Files[line.fd-3] = f
		defer f.Close()
	}
	p, err := spec.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	d := &daemon{Process: p, kind: ourDaemon}
	if line.fd >= 0 {
		spec.Files[line.fd-3].Close() // the daemon's copy is its own
	}
	if err := d.WaitSocket(sock, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if !d.Running() {
		t.Fatalf("daemon exited at start: %v\n%s", d.Err(), tail(logPath, 30))
	}

	v := startVM(t, dir, vmConfig{Kernel: k, Sock: sock, Script: "dropin", Tag: "kataShared", MemPath: "/dev/shm"})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon running: %v, exit status %d (%v)", d.Running(), d.Status().Code, d.Err())
		}
	})
	v.waitExit()
	if !d.Wait(daemonExitTimeout) {
		t.Fatalf("daemon still running %v after QEMU exited\n%s", daemonExitTimeout, tail(logPath, 20))
	}
	if d.Status().Code != 0 {
		t.Fatalf("daemon exit status %d (%v)\n%s", d.Status().Code, d.Err(), tail(logPath, 20))
	}

	g := parseConsole(v.consoleLines())
	var ran []string
	for _, s := range g.Steps {
		if s.Name == "modules" { // Linux 6.1 loads virtiofs first
			continue
		}
		ran = append(ran, fmt.Sprintf("%s rc=%d", s.Name, s.RC))
		if s.RC != 0 {
			t.Errorf("guest step %s failed (rc=%d): %s", s.Name, s.RC, strings.Join(s.Output, " | "))
		}
	}
	want := "mount rc=0, ls rc=0, cat rc=0, write rc=0, read rc=0, rm rc=0, fio rc=0, fio-rm rc=0, umount rc=0"
	if got := strings.Join(ran, ", "); got != want {
		t.Errorf("guest steps: %s\nwant %s", got, want)
	} else {
		t.Logf("guest steps: %s", got)
	}
	if got := strings.Join(g.step(t, 1, "cat").Output, "\n"); got != strings.TrimSuffix(helloContent, "\n") {
		t.Errorf("guest read hello as %q", got)
	}
	if got := strings.Join(g.step(t, 1, "read").Output, "\n"); got != "written by the guest" {
		t.Errorf("guest read back %q", got)
	}
	if b, err := os.ReadFile(filepath.Join(shared, "kept")); err != nil || string(b) != "kept\n" {
		t.Errorf("host sees kept as %q (%v)", b, err)
	}
	t.Logf("QEMU ran %.1fs (boot to mount: %v)", v.ExitTime().Sub(v.started).Seconds(), v.markerTimes(reMounted))

	// Where the log went.
	if sink != nil {
		lines := sink.lines()
		connected := false
		for _, l := range lines {
			connected = connected || strings.Contains(l, `msg="front end connected"`)
		}
		if !connected {
			t.Errorf("--syslog: %d lines arrived, none says the front end connected: %q", len(lines), lines)
		} else {
			t.Logf("--syslog: %d lines, first %q", len(lines), lines[0])
		}
		if s, _ := os.ReadFile(logPath); strings.Contains(string(s), "msg=") {
			t.Errorf("--syslog, but the daemon logged to stderr:\n%s", tail(logPath, 10))
		}
	}
	if line.debug {
		reqs := d.fuseRequests(t)
		if len(filterOpcode(reqs, "INIT")) != 1 || len(filterOpcode(reqs, "WRITE")) == 0 {
			t.Errorf("debug level: %d FUSE request lines, want one INIT and WRITEs", len(reqs))
		} else {
			t.Logf("debug level: %d FUSE request lines", len(reqs))
		}
	}
	if line.fd < 0 {
		for _, p := range []string{sock, sock + ".pid"} {
			if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s left behind after exit (%v)", p, err)
			}
		}
	}
}
