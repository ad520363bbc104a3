package integration

// Sandbox tests, run against the static daemon (GOVIRTIOFSD_INTEGRATION_BIN,
// make integration-sandbox): what the host sees of a sandboxed daemon,
// seccomp's kill and log actions on a system call outside the allowlist,
// and the unprivileged modes.
//
//	TestSandboxConfinement  an idle daemon's threads: Seccomp 2, CapEff the
//	                        kept set; its namespaces and root
//	TestSandboxSeccomp      a call outside the allowlist (sandboxtest build)
//	                        kills the daemon, traps, or is logged with
//	                        --seccomp log
//	TestSandboxUnprivileged a user with /etc/subuid and /etc/subgid ranges:
//	                        namespace sandbox in a user namespace, --sandbox
//	                        none, and one-line errors for what cannot work
//	TestStopAsSoonAsTheSocketExists  SIGTERM, SIGINT or SIGHUP the moment
//	                        the socket appears, in every sandbox mode

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// Capability bits.
const (
	capDacReadSearch = 2
	capSysAdmin      = 21
	capMknod         = 27
)

// keptCaps is the daemon's default set: CHOWN, DAC_OVERRIDE, FOWNER,
// FSETID, SETGID, SETUID, MKNOD, SETFCAP.
const keptCaps = 1<<0 | 1<<1 | 1<<3 | 1<<4 | 1<<6 | 1<<7 | 1<<capMknod | 1<<31

func needStatic(t *testing.T) {
	t.Helper()
	if sandboxMode == "" {
		t.Skip("needs the static daemon: GOVIRTIOFSD_INTEGRATION_BIN (make integration-sandbox)")
	}
}

// statusField returns field (e.g. "CapEff") of a /proc status file.
func statusField(t *testing.T, path, field string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s: in %s", field, path)
	return ""
}

// sameFile reports whether a and b are the same inode.
func sameFile(t *testing.T, a, b string) bool {
	t.Helper()
	var sa, sb syscall.Stat_t
	if err := syscall.Stat(a, &sa); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(b, &sb); err != nil {
		t.Fatal(err)
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// checkThreads checks every thread of pid: Seccomp 2 and CapEff caps.
func checkThreads(t *testing.T, pid int, caps uint64) {
	t.Helper()
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(tasks) == 0 {
		t.Fatalf("threads of %d: %v", pid, err)
	}
	for _, st := range tasks {
		if got := statusField(t, st, "Seccomp"); got != "2" {
			t.Errorf("%s: Seccomp %s, want 2 (filter)", st, got)
		}
		got, err := strconv.ParseUint(statusField(t, st, "CapEff"), 16, 64)
		if err != nil {
			t.Fatal(err)
		}
		if got != caps {
			t.Errorf("%s: CapEff %#x, want %#x", st, got, caps)
		}
	}
	t.Logf("%d threads: Seccomp 2, CapEff %#x", len(tasks), caps)
}

// TestSandboxConfinement asserts from the host, on an idle daemon that has
// served requests, what each sandbox mode promises.
func TestSandboxConfinement(t *testing.T) {
	needStatic(t)
	for _, tc := range []struct {
		name string
		args []string
		caps uint64
	}{
		// The default --inode-file-handles=prefer keeps
		// CAP_DAC_READ_SEARCH: the share's file system (the test's
		// temporary directory) gives file handles.
		{"namespace", []string{"--sandbox", "namespace"}, keptCaps | 1<<capDacReadSearch},
		{"chroot", []string{"-o", "sandbox=chroot"}, keptCaps | 1<<capDacReadSearch},
		// The rest in the namespace sandbox, whatever the run's
		// GOVIRTIOFSD_INTEGRATION_SANDBOX.
		{"fds", []string{"--sandbox", "namespace", "--inode-file-handles", "never"}, keptCaps},
		{"file-handles", []string{"--sandbox", "namespace", "--inode-file-handles", "mandatory"}, keptCaps | 1<<capDacReadSearch},
		{"modcaps", []string{"--sandbox", "namespace", "--modcaps", "-mknod:+SYS_ADMIN"},
			keptCaps&^(1<<capMknod) | 1<<capSysAdmin | 1<<capDacReadSearch},
		{"modcaps-handles", []string{"--sandbox", "namespace", "--modcaps", "-dac_read_search"}, keptCaps},
		{"none", []string{"--sandbox", "none"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A host directory the daemon is started with must not
			// reach inside the sandbox.
			leak, err := os.Open("/etc")
			if err != nil {
				t.Fatal(err)
			}
			defer leak.Close()
			// At fd 8: above the fds the supervisor hands on.
			d := startDaemonWith(t, daemonSpec{files: []*os.File{nil, nil, nil, nil, nil, leak}}, tc.args...)
			dev := d.connect(opts())
			c := newFS(t, dev, 1)
			c.mount()
			c.roundTrip(d, "f", pattern(1, 8192))
			sup, pid := d.Pid(), d.pid()
			if tc.name == "none" {
				if pid != sup {
					t.Fatalf("--sandbox none: the daemon %d has a child %d", sup, pid)
				}
				// Seccomp applies without a sandbox; capabilities
				// are root's.
				if got := statusField(t, fmt.Sprintf("/proc/%d/status", pid), "Seccomp"); got != "2" {
					t.Errorf("Seccomp %s, want 2", got)
				}
				return
			}
			if pid == sup {
				t.Fatalf("no sandboxed child under the supervisor %d", sup)
			}
			checkThreads(t, pid, tc.caps)
			fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
			if err != nil {
				t.Fatal(err)
			}
			for _, fd := range fds {
				if l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); l == "/etc" {
					t.Errorf("the sandboxed daemon holds fd %s on /etc, inherited from outside", fd.Name())
				}
			}
			if !sameFile(t, fmt.Sprintf("/proc/%d/root", pid), d.dir) {
				t.Errorf("the daemon's root is not the shared directory")
			}
			if !sameFile(t, fmt.Sprintf("/proc/%d/root", sup), "/") {
				t.Errorf("the supervisor's root is not the host's")
			}
			for _, ns := range []string{"mnt", "pid", "net", "ipc", "uts"} {
				ours, err := os.Readlink("/proc/self/ns/" + ns)
				if err != nil {
					t.Fatal(err)
				}
				theirs, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
				if err != nil {
					t.Fatal(err)
				}
				if want := tc.name != "chroot"; (ours != theirs) != want {
					t.Errorf("%s namespace: daemon %s, test %s; want distinct: %v", ns, theirs, ours, want)
				}
			}
			if tc.name == "chroot" {
				return
			}
			// Only the daemon in its pid namespace, as its pid 1.
			if got := statusField(t, fmt.Sprintf("/proc/%d/status", pid), "NSpid"); !strings.HasSuffix(got, "\t1") {
				t.Errorf("NSpid %q: want pid 1 in its namespace", got)
			}
		})
	}
}

var sandboxtest struct {
	once sync.Once
	bin  string
	err  error
}

// sandboxtestBinary builds the static daemon with -tags sandboxtest (the
// seccomp test hook) once per run.
func sandboxtestBinary(t *testing.T) string {
	t.Helper()
	sandboxtest.once.Do(func() {
		sandboxtest.bin = filepath.Join(testTmp, "govirtiofsd-sandboxtest")
		sandboxtest.err = launch.Build{Static: true, Tags: []string{"sandboxtest"}, Repo: repoTop, Out: sandboxtest.bin}.Run()
	})
	if sandboxtest.err != nil {
		t.Fatal(sandboxtest.err)
	}
	return sandboxtest.bin
}

// auditLines returns the kernel log's seccomp audit records (type 1326) of
// pid, or ok false if the kernel log cannot be read here.
func auditLines(pid int) (lines []string, ok bool) {
	out, err := exec.Command("dmesg").Output()
	if err != nil {
		return nil, false
	}
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "type=1326") && strings.Contains(l, " pid="+strconv.Itoa(pid)+" ") {
			lines = append(lines, l)
		}
	}
	return lines, true
}

// hasRecord reports whether one of the audit lines holds every string in
// want.
func hasRecord(lines []string, want ...string) bool {
	for _, l := range lines {
		all := true
		for _, w := range want {
			all = all && strings.Contains(l, w)
		}
		if all {
			return true
		}
	}
	return false
}

// TestSandboxSeccomp has the daemon call sysinfo(2), which is not on the
// allowlist, right after loading the filter (the sandboxtest build's hook):
// --seccomp kill kills it (and the supervisor reports it); trap crashes it
// with a traceback of the call; --seccomp log lets it serve and the kernel
// logs the call.
func TestSandboxSeccomp(t *testing.T) {
	needStatic(t)
	bin := sandboxtestBinary(t)
	const sysinfo = 99 // x86_64
	if runtime.GOARCH != "amd64" {
		t.Skip("the allowlist is verified on x86_64 only")
	}
	hook := []string{"GOVIRTIOFSD_SANDBOXTEST_SYSINFO=1"}

	t.Run("kill", func(t *testing.T) {
		d := startDaemonWith(t, daemonSpec{bin: bin, env: hook})
		d.expectSIGSYS = true
		if !d.Wait(opTimeout) {
			t.Fatalf("daemon still running %v after calling sysinfo under --seccomp kill", opTimeout)
		}
		// The supervisor names the killed daemon: the kernel logged
		// which call did it.
		m := regexp.MustCompile(`killed by signal SIGSYS.* pid=(\d+)`).FindStringSubmatch(d.Log())
		if m == nil {
			t.Fatalf("no report of the kill in the log:\n%s", d.Tail(5))
		}
		pid, _ := strconv.Atoi(m[1])
		lines, ok := auditLines(pid)
		if !ok {
			t.Logf("kernel log unreadable here: the exit status and the report are the proof")
			return
		}
		if !hasRecord(lines, " sig=31 ", " syscall="+strconv.Itoa(sysinfo)+" ") {
			t.Errorf("no seccomp audit record of the kill (sig=31 syscall=%d) for pid %d; records: %q", sysinfo, pid, lines)
		}
	})

	t.Run("trap", func(t *testing.T) {
		// SIGSYS to the thread: the Go runtime dies with a traceback
		// of the call (status 2, passed on by the supervisor).
		dir := t.TempDir()
		share := filepath.Join(dir, "share")
		if err := os.Mkdir(share, 0o755); err != nil {
			t.Fatal(err)
		}
		p, err := launch.Spec{Bin: bin, Env: hook, Log: filepath.Join(dir, "log"),
			Args: launch.Line{Kind: launch.Ours, Socket: filepath.Join(dir, "sock"), Share: share, Extra: []string{"--seccomp", "trap"}}.Args()}.Start()
		if err != nil {
			t.Fatal(err)
		}
		p.Stop(opTimeout)
		out := p.Log()
		if code := p.Status().Code; code != 2 || !strings.Contains(out, "SIGSYS: bad system call") ||
			!strings.Contains(out, fmt.Sprintf("syscall.RawSyscall(%#x,", sysinfo)) {
			t.Errorf("--seccomp trap: status %d, want 2 and a traceback of syscall %d:\n%s", code, sysinfo, out)
		}
	})

	t.Run("log", func(t *testing.T) {
		d := startDaemonWith(t, daemonSpec{bin: bin, env: hook}, "--seccomp", "log")
		dev := d.connect(opts())
		c := newFS(t, dev, 1)
		c.mount()
		c.roundTrip(d, "after-sysinfo", pattern(2, 4096))
		if n := d.logCount("sandboxtest: sysinfo outside the allowlist returned"); n != 1 {
			t.Fatalf("the hook ran %d times, want 1", n)
		}
		pid := d.pid()
		lines, ok := auditLines(pid)
		if !ok {
			t.Logf("kernel log unreadable here: the daemon surviving the call is the proof")
			return
		}
		if !hasRecord(lines, "syscall="+strconv.Itoa(sysinfo)+" ") {
			t.Errorf("no seccomp audit record of sysinfo for pid %d; records: %q", pid, lines)
		}
	})
}

// unprivUser is the user TestSandboxUnprivileged runs the daemon as, with
// subordinate ids from unprivSubID.
const (
	unprivUser  = "gvfs-sandbox-test"
	unprivSubID = 300000
	unprivCount = 65536
)

// ensureUnprivUser creates unprivUser and its /etc/subuid and /etc/subgid
// ranges if missing (idempotent), and removes what it added at the end.
func ensureUnprivUser(t *testing.T) (uid, gid uint32) {
	t.Helper()
	u, err := user.Lookup(unprivUser)
	if err != nil {
		out, err := exec.Command("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", unprivUser).CombinedOutput()
		if err != nil {
			t.Fatalf("useradd: %v: %s", err, out)
		}
		t.Cleanup(func() {
			if out, err := exec.Command("userdel", unprivUser).CombinedOutput(); err != nil {
				t.Errorf("userdel: %v: %s", err, out)
			}
		})
		if u, err = user.Lookup(unprivUser); err != nil {
			t.Fatal(err)
		}
	}
	line := fmt.Sprintf("%s:%d:%d\n", unprivUser, unprivSubID, unprivCount)
	for _, file := range []string{"/etc/subuid", "/etc/subgid"} {
		b, err := os.ReadFile(file)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		if bytes.Contains(b, []byte(line)) {
			continue
		}
		if len(b) > 0 && b[len(b)-1] != '\n' {
			b = append(b, '\n')
		}
		if err := os.WriteFile(file, append(b, line...), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cur, err := os.ReadFile(file)
			if err != nil {
				t.Error(err)
				return
			}
			if err := os.WriteFile(file, bytes.Replace(cur, []byte(line), nil, 1), 0o644); err != nil {
				t.Error(err)
			}
		})
	}
	u64, _ := strconv.ParseUint(u.Uid, 10, 32)
	g64, _ := strconv.ParseUint(u.Gid, 10, 32)
	return uint32(u64), uint32(g64)
}

// TestSandboxUnprivileged runs the daemon as an unprivileged user (libvirt's
// session mode).
func TestSandboxUnprivileged(t *testing.T) {
	needStatic(t)
	if _, err := exec.LookPath("newuidmap"); err != nil {
		t.Fatal("newuidmap missing: install Debian's uidmap (make deps)")
	}
	uid, gid := ensureUnprivUser(t)
	cred := &syscall.Credential{Uid: uid, Gid: gid, Groups: []uint32{}}
	maps := []string{
		"--uid-map", fmt.Sprintf(":0:%d:1:", uid), "--uid-map", fmt.Sprintf(":1:%d:%d:", unprivSubID, unprivCount),
		"--gid-map", fmt.Sprintf(":0:%d:1:", gid), "--gid-map", fmt.Sprintf(":1:%d:%d:", unprivSubID, unprivCount),
	}

	owner := func(t *testing.T, p string) (uint32, uint32) {
		t.Helper()
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Uid, st.Gid
	}

	t.Run("namespace", func(t *testing.T) {
		d := startDaemonWith(t, daemonSpec{cred: cred}, append([]string{"--sandbox", "namespace"}, maps...)...)
		dev := d.connect(opts())
		c := newFS(t, dev, 1)
		c.mount()
		c.roundTrip(d, "by-root", pattern(3, 4096))
		if u, g := owner(t, filepath.Join(d.dir, "by-root")); u != uid || g != gid {
			t.Errorf("a file the guest's root made is %d:%d on the host, want %d:%d", u, g, uid, gid)
		}
		// A guest user 1000 maps to subordinate id 300000+999.
		if err := os.Chmod(d.dir, 0o777); err != nil {
			t.Fatal(err)
		}
		c.UID, c.GID = 1000, 1000
		mkdirIn := append(le32(le32(nil, 0o755), 0), "by-1000\x00"...)
		if _, err := c.Call(vmm.OpMkdir, vmm.RootID, mkdirIn, nil, vmm.FuseEntryOutSize); err != nil {
			t.Fatalf("MKDIR as guest uid 1000: %v", err)
		}
		want := uint32(unprivSubID + 999)
		if u, g := owner(t, filepath.Join(d.dir, "by-1000")); u != want || g != want {
			t.Errorf("a directory guest uid 1000 made is %d:%d on the host, want %d:%d", u, g, want, want)
		}
		pid := d.pid()
		if pid == d.Pid() {
			t.Fatal("no sandboxed child")
		}
		// --inode-file-handles=prefer, the default, falls back to fds
		// with one line: no CAP_DAC_READ_SEARCH in the host's user
		// namespace.
		checkThreads(t, pid, keptCaps)
		if n := d.logCount("inode file handles unusable here"); n != 1 {
			t.Errorf("%d log lines on file handles, want 1\n%s", n, d.Tail(20))
		}
		if got := statusField(t, fmt.Sprintf("/proc/%d/status", pid), "Uid"); !strings.HasPrefix(got, strconv.Itoa(int(uid))+"\t") {
			t.Errorf("daemon's Uid %q, want host uid %d", got, uid)
		}
		ours, _ := os.Readlink("/proc/self/ns/user")
		theirs, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/user", pid))
		if ours == theirs {
			t.Errorf("daemon in the test's user namespace %s", ours)
		}
		if !sameFile(t, fmt.Sprintf("/proc/%d/root", pid), d.dir) {
			t.Errorf("the daemon's root is not the shared directory")
		}
	})

	t.Run("none", func(t *testing.T) {
		d := startDaemonWith(t, daemonSpec{cred: cred}, "--sandbox", "none")
		dev := d.connect(opts())
		c := newFS(t, dev, 1)
		c.mount()
		c.roundTrip(d, "f", pattern(4, 4096))
		if u, g := owner(t, filepath.Join(d.dir, "f")); u != uid || g != gid {
			t.Errorf("file is %d:%d on the host, want %d:%d", u, g, uid, gid)
		}
		if n := d.logCount("inode file handles unusable here"); n != 1 {
			t.Errorf("%d log lines on file handles, want 1\n%s", n, d.Tail(20))
		}
	})

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"chroot", []string{"--sandbox", "chroot"}, "govirtiofsd: --sandbox chroot needs root"},
		{"namespace-without-maps", []string{"--sandbox", "namespace"}, "govirtiofsd: --sandbox namespace as non-root needs --uid-map and --gid-map"},
		{"mandatory-handles", []string{"--sandbox", "none", "--inode-file-handles", "mandatory"},
			"govirtiofsd: --inode-file-handles=mandatory: open_by_handle_at is not permitted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemonWith(t, daemonSpec{cred: cred}, tc.args...)
			d.allowExit1 = true
			if !d.Wait(opTimeout) {
				t.Fatal("daemon still running")
			}
			if code := d.Status().Code; code != 1 {
				t.Errorf("exit status %d, want 1", code)
			}
			lines := strings.Split(strings.TrimSpace(d.Log()), "\n")
			if len(lines) != 1 || !strings.HasPrefix(lines[0], tc.want) {
				t.Errorf("output %q, want one line starting %q", lines, tc.want)
			}
		})
	}
}

// TestSocketLifetime: whoever created the socket (the supervisor, or the
// daemon with --sandbox none) removes it once the daemon is done, and a
// file that is not ours at the socket path is left alone.
func TestSocketLifetime(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(opts())
	newFS(t, dev, 1).mount()
	d.disconnect()
	if _, err := os.Lstat(d.sock); !os.IsNotExist(err) {
		t.Errorf("socket %s still there after the daemon exited: %v", d.sock, err)
	}

	dir := t.TempDir()
	sock := filepath.Join(dir, "not-a-socket")
	if err := os.WriteFile(sock, []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	share := filepath.Join(dir, "share")
	if err := os.Mkdir(share, 0o755); err != nil {
		t.Fatal(err)
	}
	args := launch.Line{Kind: launch.Ours, Socket: sock, Share: share, Extra: sandboxArgs()}.Args()
	out, err := exec.Command(daemonBin, args...).CombinedOutput()
	if err == nil {
		t.Fatalf("the daemon started on a path holding a regular file:\n%s", out)
	}
	if b, err := os.ReadFile(sock); err != nil || string(b) != "keep me" {
		t.Errorf("the file at the socket path: %q, %v; want it untouched", b, err)
	}
}

// TestStopAsSoonAsTheSocketExists: a front end, or systemd, may stop the
// daemon the moment its socket appears, while a sandboxed daemon's
// supervisor is still starting it or the daemon is still passing through
// its stages (in the namespace sandbox it is the init of its PID
// namespace: the kernel drops a signal it has no handler for). Whatever the
// moment and the sandbox, the process started exits 0 and leaves no socket
// and no pid file, without the supervisor having to kill the daemon.
func TestStopAsSoonAsTheSocketExists(t *testing.T) {
	seccomp := "kill"
	if sandboxMode == "" {
		seccomp = "none" // the race build
	}
	signals := []syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP}
	delays := []time.Duration{0, 0, 0, 500 * time.Microsecond, time.Millisecond, 2 * time.Millisecond,
		5 * time.Millisecond, 10 * time.Millisecond, 20 * time.Millisecond, 50 * time.Millisecond}
	for _, mode := range []string{"namespace", "chroot", "none"} {
		t.Run(mode, func(t *testing.T) {
			if mode != "none" {
				needStatic(t) // the race build is not static: it cannot run in a sandbox
			}
			for i, delay := range delays {
				sig := signals[i%len(signals)]
				dir := t.TempDir()
				sock := filepath.Join(dir, "v.sock")
				share := filepath.Join(dir, "share")
				if err := os.Mkdir(share, 0o755); err != nil {
					t.Fatal(err)
				}
				p, err := launch.Spec{Bin: daemonBin, Log: filepath.Join(dir, "log"), Args: launch.Line{Kind: launch.Ours, Socket: sock, Share: share,
					Extra: []string{"--sandbox", mode, "--seccomp", seccomp, "--log-level", "debug"}}.Args()}.Start()
				if err != nil {
					t.Fatal(err)
				}
				if err := p.WaitCreated(sock, opTimeout); err != nil {
					p.Kill()
					t.Fatalf("run %d: %v", i, err)
				}
				time.Sleep(delay)
				p.Signal(sig)
				if !p.Wait(opTimeout) {
					p.Kill()
					t.Fatalf("run %d: %v %v after the socket appeared: still running\n%s", i, sig, delay, p.Log())
				}
				if err := p.Err(); err != nil {
					t.Errorf("run %d: %v %v after the socket appeared: %v, want exit 0\n%s", i, sig, delay, err, p.Log())
				}
				if strings.Contains(p.Log(), "did not stop") {
					t.Errorf("run %d: %v %v after the socket appeared: the supervisor had to kill the daemon\n%s", i, sig, delay, p.Log())
				}
				for _, p := range []string{sock, sock + ".pid"} {
					if _, err := os.Lstat(p); !os.IsNotExist(err) {
						t.Errorf("run %d: %s left behind (%v)", i, p, err)
					}
				}
			}
		})
	}
}
