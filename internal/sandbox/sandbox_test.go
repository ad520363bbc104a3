package sandbox

import (
	"os"
	"runtime"
	"strings"
	"testing"

	seccomp "github.com/seccomp/libseccomp-golang"
)

func TestParseModcaps(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want CapSet
		bad  bool
	}{
		{"", DefaultCaps, false},
		{"+sys_admin", DefaultCaps | 1<<21, false},
		{"-mknod:+CAP_SYS_ADMIN", DefaultCaps&^(1<<27) | 1<<21, false},
		{"-chown:-chown", DefaultCaps &^ 1, false},
		{"+dac_read_search:", DefaultCaps | FileHandleCaps, false},
		{"sys_admin", 0, true},
		{"+no_such_cap", 0, true},
		{"*mknod", 0, true},
	} {
		got, err := ParseModcaps(DefaultCaps, tc.spec)
		if (err != nil) != tc.bad {
			t.Errorf("ParseModcaps(%q): error %v, want error: %v", tc.spec, err, tc.bad)
			continue
		}
		if err == nil && got != tc.want {
			t.Errorf("ParseModcaps(%q) = %s, want %s", tc.spec, got, tc.want)
		}
	}
	if got, want := DefaultCaps.String(), "chown,dac_override,fowner,fsetid,setgid,setuid,mknod,setfcap"; got != want {
		t.Errorf("DefaultCaps = %s, want %s", got, want)
	}
	if DefaultCaps != 0x880000db {
		t.Errorf("DefaultCaps = %#x, want 0x880000db", uint64(DefaultCaps))
	}
}

func TestParseIDMap(t *testing.T) {
	good := map[string]IDMap{
		":0:1000:1:":       {0, 1000, 1},
		":1:100000:65536:": {1, 100000, 65536},
	}
	for s, want := range good {
		got, err := ParseIDMap(s)
		if err != nil || got != want {
			t.Errorf("ParseIDMap(%q) = %v, %v; want %v", s, got, err, want)
		}
		if got.String() != s {
			t.Errorf("%v.String() = %q, want %q", got, got.String(), s)
		}
	}
	for _, s := range []string{"", "0:1000:1", ":0:1000:1", ":0:1000:0:", ":a:1:1:", ":0:1:1:1:", ":-1:1:1:", ":0:4294967296:1:"} {
		if m, err := ParseIDMap(s); err == nil {
			t.Errorf("ParseIDMap(%q) = %v, want an error", s, m)
		}
	}
}

func TestParseModes(t *testing.T) {
	for s, want := range map[string]Mode{"": Namespace, "namespace": Namespace, "chroot": Chroot, "none": None} {
		if got, err := ParseMode(s); err != nil || got != want {
			t.Errorf("ParseMode(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseMode("container"); err == nil {
		t.Error("ParseMode(container): no error")
	}
	for s, want := range map[string]SeccompMode{"": SeccompKill, "kill": SeccompKill, "log": SeccompLog, "trap": SeccompTrap, "none": SeccompNone} {
		if got, err := ParseSeccompMode(s); err != nil || got != want {
			t.Errorf("ParseSeccompMode(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseSeccompMode("errno"); err == nil {
		t.Error("ParseSeccompMode(errno): no error")
	}
	// Each name is its value's, both ways, and an unknown one is named
	// with the choices.
	for m := Namespace; m <= None; m++ {
		if got, err := ParseMode(m.String()); err != nil || got != m {
			t.Errorf("ParseMode(%q) = %v, %v; want %d", m, got, err, m)
		}
	}
	for m := SeccompKill; m <= SeccompNone; m++ {
		if got, err := ParseSeccompMode(m.String()); err != nil || got != m {
			t.Errorf("ParseSeccompMode(%q) = %v, %v; want %d", m, got, err, m)
		}
	}
	if _, err := ParseMode("container"); err == nil || err.Error() != `unknown sandbox mode "container" (namespace|chroot|none)` {
		t.Errorf("ParseMode(container): %v", err)
	}
	if _, err := ParseSeccompMode("errno"); err == nil || err.Error() != `unknown seccomp action "errno" (kill|log|trap|none)` {
		t.Errorf("ParseSeccompMode(errno): %v", err)
	}
}

// TestAllowlistNames: every name is a system call of this architecture
// (x86_64, the verified one) and none is listed twice.
func TestAllowlistNames(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the allowlist is spelled for x86_64")
	}
	seen := map[string]bool{}
	for _, name := range allowlist {
		if seen[name] {
			t.Errorf("%s listed twice", name)
		}
		seen[name] = true
		if _, err := seccomp.GetSyscallFromName(name); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	// Never on it: what would undo the sandbox or reach outside it.
	for _, name := range []string{"mount", "umount2", "pivot_root", "chroot", "setns", "ptrace",
		"execve", "execveat", "socket", "connect", "bind", "kill", "setuid", "setgid", "setgroups", "sysinfo"} {
		if seen[name] {
			t.Errorf("%s must not be allowed", name)
		}
	}
}

func TestEnterNone(t *testing.T) {
	if Resumed() {
		t.Skip("inside a sandbox stage")
	}
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	in, err := Enter(Config{Mode: None, Seccomp: SeccompNone, SharedDir: "/tmp"}, []File{{Name: "null", File: f}})
	if err != nil {
		t.Fatal(err)
	}
	if in.Root() != "/tmp" || in.ProcSelfFD() != nil {
		t.Errorf("--sandbox none: root %q, proc fd %v; want /tmp and none", in.Root(), in.ProcSelfFD())
	}
	if got := in.File("null"); got != f {
		t.Errorf("File(null) = %v, want the file handed in", got)
	}
	if got := in.File("null"); got != nil {
		t.Errorf("File(null) twice = %v, want nil", got)
	}
	f.Close()
}

func TestCheckPrivilege(t *testing.T) {
	m := []IDMap{{0, 1000, 1}}
	for _, tc := range []struct {
		cfg  Config
		fail bool
	}{
		{Config{Mode: Chroot, UIDMaps: m, GIDMaps: m}, true},
		{Config{Mode: Namespace, UIDMaps: m}, true},
		{Config{Mode: Namespace, UIDMaps: m, GIDMaps: m}, false},
		{Config{Mode: Namespace}, os.Geteuid() != 0},
		{Config{Mode: Chroot}, os.Geteuid() != 0},
	} {
		if err := tc.cfg.checkPrivilege(); (err != nil) != tc.fail {
			t.Errorf("%+v: %v, want failure: %v", tc.cfg, err, tc.fail)
		}
	}
}

// TestCheckStatic: a dynamically linked daemon is refused up front in the
// modes whose last stage starts inside the share (no loader there), with
// the loader named; a static one, or --sandbox none, passes.
func TestCheckStatic(t *testing.T) {
	const dynamic, static = "/bin/ls", "/bin/busybox" // busybox-static (make deps)
	for _, bin := range []string{dynamic, static} {
		if _, err := os.Stat(bin); err != nil {
			t.Skipf("%s: %v", bin, err)
		}
	}
	if interp, err := interpreter(static); err != nil || interp != "" {
		t.Fatalf("interpreter(%s) = %q, %v; want a static binary", static, interp, err)
	}
	for _, tc := range []struct {
		mode Mode
		bin  string
		fail bool
	}{
		{Namespace, dynamic, true},
		{Chroot, dynamic, true},
		{None, dynamic, false},
		{Namespace, static, false},
		{Chroot, static, false},
	} {
		cfg := Config{Mode: tc.mode}
		err := cfg.checkStatic(tc.bin)
		if (err != nil) != tc.fail {
			t.Errorf("%s with %s: %v, want failure: %v", tc.mode, tc.bin, err, tc.fail)
		}
		if err != nil && !strings.Contains(err.Error(), "ld-linux") {
			t.Errorf("%s with %s: %v does not name the loader", tc.mode, tc.bin, err)
		}
	}
}
