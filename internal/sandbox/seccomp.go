package sandbox

import (
	"fmt"
	"runtime"

	seccomp "github.com/seccomp/libseccomp-golang"
	"golang.org/x/sys/unix"
)

// SeccompMode is what happens on a system call outside the allowlist.
type SeccompMode int

const (
	// SeccompKill kills the whole process (SECCOMP_RET_KILL_PROCESS; a
	// thread-only kill would leave a hung daemon).
	SeccompKill SeccompMode = iota
	// SeccompLog allows the call and logs it to the kernel log (audit
	// type 1326): for finding what a new code path needs.
	SeccompLog
	// SeccompTrap sends SIGSYS to the thread; the Go runtime crashes with
	// a traceback of the offending goroutine.
	SeccompTrap
	// SeccompNone loads no filter.
	SeccompNone
)

// seccompNames are the SeccompModes' names on the command line, by mode.
var seccompNames = []string{"kill", "log", "trap", "none"}

// ParseSeccompMode parses kill|log|trap|none ("": kill).
func ParseSeccompMode(s string) (SeccompMode, error) {
	return parseName[SeccompMode]("seccomp action", seccompNames, s)
}

func (m SeccompMode) String() string { return seccompNames[m] }

// allowlist is every system call the daemon makes once it serves, by its
// x86_64 name (the list is verified on x86_64 only: run the integration
// suite and the e2e workload under --seccomp kill on another architecture
// before relying on it there). The only proof that it is complete is the
// whole daemon running under it: the integration suite and the e2e guest
// workload run with the default --seccomp kill.
var allowlist = [...]string{
	// Go runtime: threads, scheduling, memory, signals, timers.
	"clone", "clone3", // clone3: glibc's pthread_create has no fallback if it fails
	"exit", "exit_group", "futex", "sched_yield", "nanosleep", "clock_nanosleep",
	"clock_gettime", "gettimeofday", "getpid", "gettid", "tgkill",
	"rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "restart_syscall",
	"mmap", "munmap", "mprotect", "madvise", "mremap", "brk", "rseq", "set_robust_list",
	"sched_getaffinity", "getrandom", "prlimit64", "getrlimit",
	// Go runtime netpoller and the vhost-user transport: the socket, the
	// kick and call eventfds, guest memory mapped from memfds.
	"epoll_create1", "epoll_ctl", "epoll_pwait", "epoll_pwait2", "epoll_wait", "eventfd2",
	"accept4", "recvmsg", "sendmsg", "shutdown", "getsockname", "getsockopt",
	"read", "write", "readv", "writev", "pread64", "pwrite64", "close", "fcntl", "dup", "dup3",
	"fstat", "newfstatat", "lseek", "ppoll", "pipe2",
	// The metrics listener (--metrics-addr): Go sets TCP_NODELAY and
	// keep-alive on every accepted TCP connection.
	"setsockopt",
	// File system operations (internal/passthrough).
	"openat", "openat2", "open_by_handle_at", "name_to_handle_at", "statx", "statfs", "fstatfs",
	"getdents64", "readlinkat", "mkdirat", "mknodat", "symlinkat", "linkat", "unlinkat", "renameat2",
	"fchmod", "fchmodat", "fchownat", "utimensat", "ftruncate", "fallocate", "fsync", "fdatasync",
	"syncfs", "copy_file_range", "preadv", "pwritev", "preadv2", "pwritev2", "flock",
	"getxattr", "fgetxattr", "lgetxattr", "setxattr", "fsetxattr", "lsetxattr",
	"listxattr", "flistxattr", "llistxattr", "removexattr", "fremovexattr", "lremovexattr",
	// DAX (--cache-size): the memfd copies of mapped files' tails
	// (passthrough dax.go; pread64, pwrite64, ftruncate, mmap are above),
	// and the inotify watch that refreshes them after host writes
	// (daxwatch.go).
	"memfd_create", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
	// Per-request credentials on the passthrough's locked threads; each
	// of those threads has a private fs_struct (umask, cwd).
	"setfsuid", "setfsgid", "umask", "fchdir",
	"geteuid", "getegid", "getuid", "getgid", "getgroups",
}

// unshareFlags are the only unshare(2) flags allowed: the passthrough's
// credential threads unshare their fs_struct.
const unshareFlags = unix.CLONE_FS

// loadSeccomp loads the allowlist on every thread of the process (libseccomp
// sets SECCOMP_FILTER_FLAG_TSYNC) with mode's action for anything else.
// It returns the number of rules.
func loadSeccomp(mode SeccompMode) (int, error) {
	var act seccomp.ScmpAction
	switch mode {
	case SeccompNone:
		return 0, nil
	case SeccompKill:
		act = seccomp.ActKillProcess
	case SeccompLog:
		act = seccomp.ActLog
	case SeccompTrap:
		act = seccomp.ActTrap
	}
	f, err := seccomp.NewFilter(act)
	if err != nil {
		return 0, fmt.Errorf("seccomp: %w", err)
	}
	defer f.Release()
	n := 0
	for _, name := range allowlist {
		sc, err := seccomp.GetSyscallFromName(name)
		if err != nil {
			if runtime.GOARCH == "amd64" {
				return 0, fmt.Errorf("seccomp: system call %q: %w", name, err)
			}
			continue // not a system call on this architecture
		}
		if err := f.AddRule(sc, seccomp.ActAllow); err != nil {
			return 0, fmt.Errorf("seccomp: allowing %s: %w", name, err)
		}
		n++
	}
	unshare, err := seccomp.GetSyscallFromName("unshare")
	if err != nil {
		return 0, fmt.Errorf("seccomp: %w", err)
	}
	cond, err := seccomp.MakeCondition(0, seccomp.CompareEqual, unshareFlags)
	if err != nil {
		return 0, fmt.Errorf("seccomp: %w", err)
	}
	if err := f.AddRuleConditional(unshare, seccomp.ActAllow, []seccomp.ScmpCondition{cond}); err != nil {
		return 0, fmt.Errorf("seccomp: allowing unshare(CLONE_FS): %w", err)
	}
	n++
	// A creation runs with the guest caller's supplementary groups
	// (FUSE_EXT_GROUPS) on its own thread: setgroups of at most
	// maxCreateGroups groups (and of none, to drop them), never more.
	setgroups, err := seccomp.GetSyscallFromName("setgroups")
	if err != nil {
		return 0, fmt.Errorf("seccomp: %w", err)
	}
	if cond, err = seccomp.MakeCondition(0, seccomp.CompareLessOrEqual, maxCreateGroups); err != nil {
		return 0, fmt.Errorf("seccomp: %w", err)
	}
	if err := f.AddRuleConditional(setgroups, seccomp.ActAllow, []seccomp.ScmpCondition{cond}); err != nil {
		return 0, fmt.Errorf("seccomp: allowing setgroups of a few groups: %w", err)
	}
	n++
	// --inode-dax flag reads a file's FS_XFLAG_DAX: ioctl
	// FS_IOC_FSGETXATTR, and no other ioctl.
	ioctl, err := seccomp.GetSyscallFromName("ioctl")
	if err != nil {
		return 0, fmt.Errorf("seccomp: %w", err)
	}
	if cond, err = seccomp.MakeCondition(1, seccomp.CompareEqual, fsIocFsGetXattr); err != nil {
		return 0, fmt.Errorf("seccomp: %w", err)
	}
	if err := f.AddRuleConditional(ioctl, seccomp.ActAllow, []seccomp.ScmpCondition{cond}); err != nil {
		return 0, fmt.Errorf("seccomp: allowing ioctl(FS_IOC_FSGETXATTR): %w", err)
	}
	n++
	if err := f.Load(); err != nil {
		return 0, fmt.Errorf("seccomp: loading the filter: %w", err)
	}
	return n, nil
}

// fsIocFsGetXattr is FS_IOC_FSGETXATTR, _IOR('X', 31, struct fsxattr of
// 28 bytes), the passthrough's only ioctl.
const fsIocFsGetXattr = 0x801c581f

// maxCreateGroups is internal/fuse.MaxGroups: the most supplementary groups
// a creation request carries, which the passthrough sets with setgroups.
const maxCreateGroups = 32
