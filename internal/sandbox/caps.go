package sandbox

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Capability numbers (linux/capability.h), by their names without CAP_.
var capNames = map[string]int{
	"chown": 0, "dac_override": 1, "dac_read_search": 2, "fowner": 3, "fsetid": 4,
	"kill": 5, "setgid": 6, "setuid": 7, "setpcap": 8, "linux_immutable": 9,
	"net_bind_service": 10, "net_broadcast": 11, "net_admin": 12, "net_raw": 13,
	"ipc_lock": 14, "ipc_owner": 15, "sys_module": 16, "sys_rawio": 17, "sys_chroot": 18,
	"sys_ptrace": 19, "sys_pacct": 20, "sys_admin": 21, "sys_boot": 22, "sys_nice": 23,
	"sys_resource": 24, "sys_time": 25, "sys_tty_config": 26, "mknod": 27, "lease": 28,
	"audit_write": 29, "audit_control": 30, "setfcap": 31, "mac_override": 32,
	"mac_admin": 33, "syslog": 34, "wake_alarm": 35, "block_suspend": 36,
	"audit_read": 37, "perfmon": 38, "bpf": 39, "checkpoint_restore": 40,
}

// CapSet is a set of capabilities, bit n for capability n.
type CapSet uint64

// DefaultCaps is what the passthrough needs as root (DESIGN §5): change
// owners and modes of any file, create device nodes, switch fsuid/fsgid,
// keep set-id bits, set file capabilities.
var DefaultCaps = capSetOf("chown", "dac_override", "fowner", "fsetid", "setgid", "setuid", "mknod", "setfcap")

// FileHandleCaps is added for --inode-file-handles: open_by_handle_at
// needs CAP_DAC_READ_SEARCH.
var FileHandleCaps = capSetOf("dac_read_search")

func capSetOf(names ...string) CapSet {
	var s CapSet
	for _, n := range names {
		c, ok := capNames[n]
		if !ok {
			panic("sandbox: unknown capability " + n)
		}
		s |= 1 << c
	}
	return s
}

// Has reports whether c is in s.
func (s CapSet) Has(c int) bool { return c >= 0 && c < 64 && s&(1<<c) != 0 }

// String lists the set as the kernel's names, e.g. "chown,fowner".
func (s CapSet) String() string {
	var names []string
	for c := 0; c < 64; c++ {
		if !s.Has(c) {
			continue
		}
		name := "cap_" + strconv.Itoa(c)
		for n, v := range capNames {
			if v == c {
				name = n
			}
		}
		names = append(names, name)
	}
	return strings.Join(names, ",")
}

// ParseModcaps applies a --modcaps list ("+sys_admin:-mknod", names with
// or without cap_, any case) to base.
func ParseModcaps(base CapSet, spec string) (CapSet, error) {
	s := base
	if spec == "" {
		return s, nil
	}
	for _, item := range strings.Split(spec, ":") {
		if item == "" {
			continue
		}
		op, name := item[0], strings.TrimPrefix(strings.ToLower(item[1:]), "cap_")
		c, ok := capNames[name]
		if !ok || (op != '+' && op != '-') {
			return 0, fmt.Errorf("--modcaps %q: want +name or -name, got %q", spec, item)
		}
		if op == '+' {
			s |= 1 << c
		} else {
			s &^= 1 << c
		}
	}
	return s, nil
}

// lastCap is the highest capability the running kernel knows.
func lastCap() (int, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("reading cap_last_cap: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 || n > 63 {
		return 0, fmt.Errorf("cap_last_cap %q", bytes.TrimSpace(b))
	}
	return n, nil
}

// dropBounding removes every capability not in keep from the calling
// thread's bounding set. The thread must then exec: the new program's
// permitted and effective sets are the bounding set (for uid 0), and it
// starts with this one thread, so every thread it ever creates holds
// exactly keep (DESIGN §8: capset per thread does not reach the Go
// runtime's other threads). The caller holds its OS thread locked.
func dropBounding(keep CapSet, last int) error {
	for c := 0; c <= last; c++ {
		if keep.Has(c) {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			return fmt.Errorf("dropping capability %d from the bounding set: %w", c, err)
		}
	}
	return nil
}

// effectiveCaps reads the calling thread's effective set.
func effectiveCaps() (CapSet, error) {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return 0, fmt.Errorf("capget: %w", err)
	}
	return CapSet(data[0].Effective) | CapSet(data[1].Effective)<<32, nil
}

// verifyThreads checks through procSelfFD (an O_PATH fd of /proc/self/fd)
// that every thread of the process has the effective set want, and that it
// is inside keep.
func verifyThreads(procSelfFD int, want, keep CapSet) error {
	if want&^keep != 0 {
		return fmt.Errorf("effective capabilities %s exceed the kept set %s", want, keep)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tfd, err := unix.Openat(procSelfFD, "../task", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening /proc/self/task: %w", err)
	}
	dir := os.NewFile(uintptr(tfd), "/proc/self/task")
	defer dir.Close()
	tids, err := dir.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("listing /proc/self/task: %w", err)
	}
	for _, tid := range tids {
		fd, err := unix.Openat(tfd, tid+"/status", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("opening task %s status: %w", tid, err)
		}
		f := os.NewFile(uintptr(fd), "status")
		got, err := capEffLine(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("task %s: %w", tid, err)
		}
		if got != want {
			return fmt.Errorf("task %s has effective capabilities %s, want %s", tid, got, want)
		}
	}
	return nil
}

func capEffLine(f *os.File) (CapSet, error) {
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return CapSet(n), err
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no CapEff line")
}
