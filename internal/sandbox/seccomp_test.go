package sandbox

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// errnoErr turns a raw call's errno into an error (nil for 0).
func errnoErr(e syscall.Errno) error {
	if e != 0 {
		return e
	}
	return nil
}

// seccompChildEnv names the case a re-executed test binary runs under the
// filter (TestSeccompConditionalRules).
const seccompChildEnv = "GOVIRTIOFSD_SECCOMP_CHILD"

// seccompCases are calls made under the filter with --seccomp kill: the
// allowed ones print "allowed"; the others must kill the process first.
var seccompCases = map[string]struct {
	call    func() error
	allowed bool
}{
	// No ring server places its thread any more: the daemon never
	// changes a thread's CPUs.
	"setaffinity self": {func() error {
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(0, &set); err != nil {
			return err
		}
		return unix.SchedSetaffinity(0, &set)
	}, false},
	// Raw calls, as the passthrough makes them: they change only the
	// calling thread (Go's Setgroups would change every thread).
	"setgroups one": {func() error {
		g := uint32(os.Getegid())
		_, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 1, uintptr(unsafe.Pointer(&g)), 0)
		return errnoErr(e)
	}, true},
	"setgroups none": {func() error {
		_, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0)
		return errnoErr(e)
	}, true},
	"setgroups two": {func() error {
		g := [2]uint32{uint32(os.Getegid()), uint32(os.Getegid())}
		_, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 2, uintptr(unsafe.Pointer(&g[0])), 0)
		return errnoErr(e)
	}, true},
	"setgroups most": {func() error {
		var g [maxCreateGroups]uint32
		for i := range g {
			g[i] = uint32(os.Getegid())
		}
		_, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, maxCreateGroups, uintptr(unsafe.Pointer(&g[0])), 0)
		return errnoErr(e)
	}, true},
	"setgroups too many": {func() error {
		var g [maxCreateGroups + 1]uint32
		for i := range g {
			g[i] = uint32(os.Getegid())
		}
		_, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, maxCreateGroups+1, uintptr(unsafe.Pointer(&g[0])), 0)
		return errnoErr(e)
	}, false},
	// DAX: the tails' memfds; FS_IOC_FSGETXATTR and no other ioctl
	// (an answer of the file system's, ENOTTY say, is not a kill).
	"memfd_create": {func() error {
		fd, err := unix.MemfdCreate("t", unix.MFD_CLOEXEC)
		if err == nil {
			unix.Close(fd)
		}
		return err
	}, true},
	"ioctl fsgetxattr": {func() error {
		var b [28]byte
		_, _, e := unix.Syscall(unix.SYS_IOCTL, 0, fsIocFsGetXattr, uintptr(unsafe.Pointer(&b[0])))
		if e == unix.ENOTTY || e == unix.EOPNOTSUPP || e == unix.EINVAL || e == unix.EBADF {
			return nil
		}
		return errnoErr(e)
	}, true},
	"ioctl tcgets": {func() error {
		var b [64]byte
		_, _, e := unix.Syscall(unix.SYS_IOCTL, 0, unix.TCGETS, uintptr(unsafe.Pointer(&b[0])))
		_ = e
		return nil
	}, false},
	"unshare fs":    {func() error { return unix.Unshare(unix.CLONE_FS) }, true},
	"unshare mount": {func() error { return unix.Unshare(unix.CLONE_NEWNS) }, false},
}

// TestSeccompConditionalRules: the calls the filter allows only with
// some argument values, unshare(CLONE_FS) and setgroups of at most
// maxCreateGroups groups, pass with it and kill the process with any other. Each
// case runs in a re-executed test binary that loads the filter.
func TestSeccompConditionalRules(t *testing.T) {
	if name := os.Getenv(seccompChildEnv); name != "" {
		runSeccompChild(name)
		return
	}
	for name, c := range seccompCases {
		t.Run(name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestSeccompConditionalRules$")
			cmd.Env = append(os.Environ(), seccompChildEnv+"="+name)
			out, err := cmd.CombinedOutput()
			got := strings.TrimSpace(string(out))
			if c.allowed {
				if err != nil || got != "allowed" {
					t.Fatalf("want it allowed; exit %v, output %q", err, got)
				}
				return
			}
			ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
			if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGSYS {
				t.Fatalf("want the process killed by SIGSYS; exit %v, output %q", err, got)
			}
		})
	}
}

// runSeccompChild loads the filter, makes one call and exits: 0 with
// "allowed" if the call was allowed, 1 on an error.
func runSeccompChild(name string) {
	c, ok := seccompCases[name]
	if !ok {
		fmt.Println("unknown case", name)
		os.Exit(1)
	}
	if _, err := loadSeccomp(SeccompKill); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	if err := c.call(); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	fmt.Println("allowed")
	os.Exit(0)
}
