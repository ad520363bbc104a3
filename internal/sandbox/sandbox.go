// Package sandbox confines govirtiofsd before it serves a guest. It owns the
// process layer under the file system: the re-exec of the daemon into new
// namespaces (or a chroot) and the supervising process left outside, the
// mount table of the confined process (pivot_root into the shared
// directory, the old root detached, /proc reachable only as one O_PATH fd
// of /proc/self/fd), the user namespace and its id maps for unprivileged
// use, the capability bounding set and the final exec that makes it every
// thread's set, the seccomp allowlist, and the files opened outside the
// sandbox and handed in by fd (DESIGN §5 and §8). It knows nothing of FUSE
// or vhost-user beyond the system calls they make.
//
// A sandboxed daemon runs as two processes, each going through stages of
// the same binary, told apart by the environment variable
// GOVIRTIOFSD_SANDBOX_STAGE: the supervisor, wait and reaped stages in the
// process as started, the userns, init and final stages in the daemon:
//
//	supervisor  the process as started: opens everything outside the
//	            share (the vhost-user socket, ...), starts the next stage
//	            in new mount, pid, net, ipc and uts namespaces (namespace)
//	            or none (chroot), then execs itself as the wait stage
//	wait        the supervisor, in C before the Go runtime starts
//	            (waiter.c): forwards SIGTERM/SIGINT/SIGHUP until the
//	            daemon ends, then execs itself as the reaped stage
//	reaped      the supervisor in Go again: reports how the daemon
//	            ended, removes what the first process created and exits
//	            with the daemon's status
//	userns      unprivileged only: in a new user namespace, waits for the
//	            supervisor to write the id maps, then execs itself to gain
//	            its capabilities there
//	init        mounts a fresh /proc, takes an O_PATH fd of /proc/self/fd,
//	            bind-mounts the share onto itself, pivot_root(".", ".") and
//	            detaches the old root (or chroots into the share), drops
//	            every capability not kept from the bounding set and
//	            execveat()s the final stage from an fd of /proc/self/exe
//	final       starts with one thread holding exactly the kept
//	            capabilities, checks that every thread does, serves; the
//	            seccomp filter is loaded (on every thread) by Inside.Lock
//	            before the first request
//
// With --sandbox none the daemon runs in one process: no namespace, no
// chroot, no capability change; the seccomp filter still applies.
//
// Files cross the stages as inherited fds named in GOVIRTIOFSD_SANDBOX_FILES
// ("name=fd,..."): a caller adds a file with one File{Name, File} in the
// supervisor and takes it back with Inside.File(name) in the final stage.
package sandbox

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Mode is the --sandbox mode.
type Mode int

const (
	// Namespace: new mount, pid, net, ipc and uts namespaces (and a user
	// namespace with id maps), pivot_root into the shared directory.
	Namespace Mode = iota
	// Chroot: chroot into the shared directory, for containers that
	// already isolate the daemon.
	Chroot
	// None: no confinement beyond the passthrough's own checks.
	None
)

// modeNames are the Modes' names on the command line, by Mode.
var modeNames = []string{"namespace", "chroot", "none"}

// ParseMode parses namespace|chroot|none ("": namespace).
func ParseMode(s string) (Mode, error) { return parseName[Mode]("sandbox mode", modeNames, s) }

func (m Mode) String() string { return modeNames[m] }

// parseName parses one of the names of an enumeration (what), given by
// value: names[v] is v's; "" is the default, the value 0.
func parseName[T ~int](what string, names []string, s string) (T, error) {
	if s == "" {
		return 0, nil
	}
	if i := slices.Index(names, s); i >= 0 {
		return T(i), nil
	}
	return 0, fmt.Errorf("unknown %s %q (%s)", what, s, strings.Join(names, "|"))
}

// Config is the sandbox of one daemon. Every stage builds the same Config
// from the same command line.
type Config struct {
	Mode      Mode
	Seccomp   SeccompMode
	SharedDir string
	// Caps is the set kept when the daemon runs as root (or as root of
	// its user namespace): DefaultCaps, plus FileHandleCaps with file
	// handles, as changed by --modcaps.
	Caps CapSet
	// UIDMaps and GIDMaps, if given, put the namespace sandbox in a new
	// user namespace with these maps (required when not root).
	UIDMaps, GIDMaps []IDMap
	Log              *slog.Logger
	// Signals, if not nil, carries the signals that stop the daemon
	// (SIGTERM, SIGINT, SIGHUP), registered by the caller before it made
	// anything the supervisor must remove; otherwise the supervisor
	// registers them itself when it starts.
	Signals <-chan os.Signal
	// Keep are files the supervisor holds until the daemon has ended
	// (the pid file's lock): they stay open through its wait and reaped
	// stages. Every other file is closed when it leaves Go.
	Keep []*os.File
	// Hold, if not nil, is closed when the supervisor's Go code has done
	// what it does besides waiting (--daemonize's relay of the daemon's
	// readiness): it leaves Go only then, or at the first stop signal.
	Hold <-chan struct{}
}

// File is a file opened outside the sandbox and handed in by fd.
type File struct {
	Name string
	File *os.File
}

const (
	envFiles = "GOVIRTIOFSD_SANDBOX_FILES" // envStage: waiter.go

	stageUserns = "userns"
	stageInit   = "init"
	stageFinal  = "final"

	// Names of the stages' own files.
	fileProcSelfFD = "sandbox:proc-self-fd"
	fileSync       = "sandbox:sync"
)

// Resumed reports whether this process is a later stage of a sandboxed
// daemon: it must open nothing outside the share (it cannot: the files
// it needs are waiting in Inside.File).
func Resumed() bool {
	stage := os.Getenv(envStage)
	return stage != "" && stage != stageReaped
}

// Exit is returned by Enter in the supervisor once the sandboxed daemon has
// exited: the caller exits with Code (what went wrong is already logged).
type Exit struct{ Code int }

func (e *Exit) Error() string { return fmt.Sprintf("sandboxed daemon exited with status %d", e.Code) }

// Inside is the confined process as the daemon sees it.
type Inside struct {
	cfg        Config
	root       string
	procSelfFD *os.File
	files      map[string]*os.File
}

// Root is the shared directory as this process names it: "/" inside a
// namespace or chroot sandbox.
func (in *Inside) Root() string { return in.root }

// ProcSelfFD is an O_PATH fd of /proc/self/fd taken before the sandbox
// closed, or nil with --sandbox none (open your own).
func (in *Inside) ProcSelfFD() *os.File { return in.procSelfFD }

// File returns the file handed in as name (nil if none) and forgets it:
// the caller owns it.
func (in *Inside) File(name string) *os.File {
	f := in.files[name]
	delete(in.files, name)
	return f
}

// Lock loads the seccomp filter on every thread: the last step before the
// daemon serves. Anything the daemon needs to do outside the allowlist
// (net.FileListener's getsockopt, opening the root, probing file
// handles) must be done before. It logs to log (the daemon's final
// logger: a syslog connection handed in replaces Config.Log's stderr).
func (in *Inside) Lock(log *slog.Logger) error {
	eff, _ := effectiveCaps()
	n, err := loadSeccomp(in.cfg.Seccomp)
	if err != nil {
		return err
	}
	log.Info("sandbox closed", "sandbox", in.cfg.Mode.String(), "seccomp", in.cfg.Seccomp.String(),
		"seccomp_rules", n, "capabilities", eff.String())
	testHook(log)
	return nil
}

// Enter confines the process as cfg says. In the supervisor it takes
// ownership of files (it closes its copies once the next stage holds
// them), starts the sandboxed daemon and hands the waiting for it over to
// the wait stage: it returns only errors, or *Exit if a stop signal came
// before the daemon was started. In the reaped stage (Reaped) it reports
// how the daemon ended and returns *Exit; in the userns and init stages it
// execs the next stage and returns only errors; in the final stage, and
// with --sandbox none, it returns the Inside the daemon serves from.
func Enter(cfg Config, files []File) (*Inside, error) {
	switch stage := os.Getenv(envStage); stage {
	case "":
		if cfg.Mode == None {
			runtime.UnlockOSThread() // no supervisor: the main thread is free (init in waiter.go)
			in := &Inside{cfg: cfg, root: cfg.SharedDir, files: map[string]*os.File{}}
			for _, f := range files {
				in.files[f.Name] = f.File
			}
			return in, nil
		}
		if err := cfg.checkPrivilege(); err != nil {
			closeFiles(files)
			return nil, err
		}
		if err := cfg.checkStatic("/proc/self/exe"); err != nil {
			closeFiles(files)
			return nil, err
		}
		code, err := supervise(cfg, files)
		if err != nil {
			return nil, err
		}
		return nil, &Exit{Code: code}
	case stageReaped:
		code, err := reaped(cfg)
		if err != nil {
			return nil, err
		}
		return nil, &Exit{Code: code}
	case stageUserns:
		return nil, awaitIDMaps()
	case stageInit:
		return nil, confine(cfg)
	case stageFinal:
		return resume(cfg)
	default:
		return nil, fmt.Errorf("%s=%q: unknown sandbox stage", envStage, stage)
	}
}

// checkPrivilege turns a mode that cannot work into one clear error.
func (cfg *Config) checkPrivilege() error {
	userns := len(cfg.UIDMaps) > 0 || len(cfg.GIDMaps) > 0
	switch {
	case userns && cfg.Mode != Namespace:
		return errors.New("--uid-map/--gid-map need --sandbox namespace")
	case userns && (len(cfg.UIDMaps) == 0 || len(cfg.GIDMaps) == 0):
		return errors.New("give both --uid-map and --gid-map")
	case os.Geteuid() == 0 || userns:
		return nil
	case cfg.Mode == Chroot:
		return errors.New("--sandbox chroot needs root (use --sandbox none, or --sandbox namespace with --uid-map/--gid-map)")
	default:
		return errors.New("--sandbox namespace as non-root needs --uid-map and --gid-map (or use --sandbox none)")
	}
}

func closeFiles(files []File) {
	for _, f := range files {
		f.File.Close()
	}
}

// supervise starts the first confined stage with files and hands the
// waiting for the daemon over to the wait stage (handOver). It returns 0
// if a termination signal came before the daemon was started, and errors.
func supervise(cfg Config, files []File) (int, error) {
	// The child's parent-death signal fires when the thread that started
	// it exits: keep this one until the child is gone, and exec from it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// Relative paths of the command line name files here: the reaped
	// stage learns where (WorkDir).
	dir := WorkDir()

	userns := len(cfg.UIDMaps) > 0
	stage := stageInit
	var syncW *os.File
	if userns {
		r, w, err := os.Pipe()
		if err != nil {
			closeFiles(files)
			return 0, fmt.Errorf("sandbox: %w", err)
		}
		files = append(files, File{Name: fileSync, File: r})
		syncW = w
		defer w.Close()
		stage = stageUserns
	}
	defer func() { closeFiles(files) }() // those not yet closed after Start

	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	var names []string
	for i, f := range files {
		cmd.ExtraFiles = append(cmd.ExtraFiles, f.File)
		names = append(names, f.Name+"="+strconv.Itoa(3+i))
	}
	cmd.Env = append(stageEnv(os.Environ()), envStage+"="+stage, envFiles+"="+strings.Join(names, ","))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if cfg.Mode == Namespace {
		cmd.SysProcAttr.Cloneflags = unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET |
			unix.CLONE_NEWIPC | unix.CLONE_NEWUTS
		if userns {
			cmd.SysProcAttr.Cloneflags |= unix.CLONE_NEWUSER
		}
	}
	sigs := cfg.Signals
	if sigs == nil {
		own := make(chan os.Signal, 1)
		signal.Notify(own, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
		defer signal.Stop(own)
		sigs = own
	}
	select {
	case s := <-sigs:
		cfg.Log.Info("signal received before the daemon started; not starting it", "signal", s.String())
		return 0, nil
	default:
	}
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("sandbox: starting the %s sandbox: %w", cfg.Mode, err)
	}
	closeFiles(files)
	files = nil
	if userns {
		if err := writeIDMaps(cmd.Process.Pid, cfg.UIDMaps, cfg.GIDMaps); err != nil {
			cmd.Process.Kill()
			cmd.Wait()
			return 0, fmt.Errorf("sandbox: %w", err)
		}
		if _, err := syncW.Write([]byte{1}); err != nil {
			cmd.Process.Kill()
			cmd.Wait()
			return 0, fmt.Errorf("sandbox: releasing the user namespace: %w", err)
		}
	}
	cfg.Log.Debug("sandboxed daemon started", "pid", cmd.Process.Pid, "sandbox", cfg.Mode.String())

	var first os.Signal
	if cfg.Hold != nil {
		select {
		case <-cfg.Hold:
		case first = <-sigs:
		}
	}
	err := handOver(cfg, cmd.Process.Pid, sigs, first, dir)
	// Still here: the daemon must not outlive its supervisor.
	cmd.Process.Kill()
	cmd.Wait()
	return 0, err
}

// stageEnv returns env without the sandbox's own variables.
func stageEnv(env []string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, envStage+"=") && !strings.HasPrefix(kv, envFiles+"=") {
			out = append(out, kv)
		}
	}
	return out
}

// inherited parses GOVIRTIOFSD_SANDBOX_FILES.
func inherited() (map[string]*os.File, error) {
	files := map[string]*os.File{}
	spec := os.Getenv(envFiles)
	if spec == "" {
		return files, nil
	}
	for _, item := range strings.Split(spec, ",") {
		name, num, ok := strings.Cut(item, "=")
		fd, err := strconv.Atoi(num)
		if !ok || err != nil || fd < 3 {
			return nil, fmt.Errorf("%s: bad entry %q", envFiles, item)
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
			return nil, fmt.Errorf("inherited file %s (fd %d): %w", name, fd, err)
		}
		files[name] = os.NewFile(uintptr(fd), name)
	}
	return files, nil
}

// awaitIDMaps runs in a new user namespace before its maps exist: it holds
// no capability there, and execs itself once the supervisor has written the
// maps, gaining them (as the namespace's root).
func awaitIDMaps() error {
	files, err := inherited()
	if err != nil {
		return err
	}
	sync := files[fileSync]
	if sync == nil {
		return errors.New("sandbox: no sync pipe")
	}
	var b [1]byte
	if n, _ := sync.Read(b[:]); n != 1 {
		return errors.New("sandbox: the supervisor did not write the id maps")
	}
	sync.Close()
	delete(files, fileSync)
	exe, err := unix.Open("/proc/self/exe", unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("sandbox: opening /proc/self/exe: %w", err)
	}
	return execStage(exe, stageInit, files)
}

// confine is the init stage: it closes the sandbox around the shared
// directory and execs the final stage.
func confine(cfg Config) error {
	runtime.LockOSThread() // this thread drops the bounding set, then execs
	unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0)
	files, err := inherited()
	if err != nil {
		return err
	}
	last, err := lastCap()
	if err != nil {
		return err
	}
	// Nothing but the named files crosses into the final stage: an fd
	// the daemon was started with (of a host directory, say) would be a
	// way out. execStage clears close-on-exec on the named files again.
	if err := cloexecFrom(3); err != nil {
		return err
	}
	var procSelfFD, exe int
	switch cfg.Mode {
	case Namespace:
		procSelfFD, exe, err = pivotIntoShare(cfg.SharedDir)
	case Chroot:
		procSelfFD, exe, err = chrootIntoShare(cfg.SharedDir)
	default:
		err = fmt.Errorf("sandbox mode %s has no init stage", cfg.Mode)
	}
	if err != nil {
		return err
	}
	files[fileProcSelfFD] = os.NewFile(uintptr(procSelfFD), fileProcSelfFD)
	// No core dump: it would land in the shared directory.
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{}); err != nil {
		return fmt.Errorf("sandbox: RLIMIT_CORE: %w", err)
	}
	if err := dropBounding(cfg.Caps, last); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	return execStage(exe, stageFinal, files)
}

// pivotIntoShare makes the shared directory the root of this (new) mount
// namespace. It returns an O_PATH fd of /proc/self/fd of a fresh proc
// mount, which stays usable after its mount point is gone, and one of this
// executable for the final exec: no file of the host is reachable by path
// afterwards.
func pivotIntoShare(dir string) (procSelfFD, exe int, err error) {
	step := func(what string, err error) error {
		if err == nil {
			return nil
		}
		if errors.Is(err, unix.EPERM) && os.Geteuid() != 0 {
			return fmt.Errorf("sandbox: %s: %w (the namespace sandbox needs root, or --uid-map/--gid-map)", what, err)
		}
		return fmt.Errorf("sandbox: %s: %w", what, err)
	}
	// Mounts made here must not propagate back to the host.
	if err := step("making / a slave mount", unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, "")); err != nil {
		return -1, -1, err
	}
	// A proc of the new pid namespace: /proc/self/fd names this
	// process's fds, and no other process is visible through it.
	if err := step("mounting /proc", unix.Mount("proc", "/proc", "proc",
		unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "")); err != nil {
		return -1, -1, err
	}
	// Not close-on-exec: the final stage inherits it.
	procSelfFD, err = unix.Open("/proc/self/fd", unix.O_PATH|unix.O_DIRECTORY, 0)
	if err := step("opening /proc/self/fd", err); err != nil {
		return -1, -1, err
	}
	exe, err = unix.Open("/proc/self/exe", unix.O_PATH|unix.O_CLOEXEC, 0)
	if err := step("opening /proc/self/exe", err); err != nil {
		return -1, -1, err
	}
	if err := step("bind-mounting "+dir, unix.Mount(dir, dir, "", unix.MS_BIND|unix.MS_REC, "")); err != nil {
		return -1, -1, err
	}
	if err := step("chdir "+dir, unix.Chdir(dir)); err != nil {
		return -1, -1, err
	}
	// The old root ends up stacked on ".": detach it, and with it every
	// host mount, the fresh /proc included (the fd above keeps it).
	if err := step("pivot_root", unix.PivotRoot(".", ".")); err != nil {
		return -1, -1, err
	}
	if err := step("detaching the old root", unix.Unmount(".", unix.MNT_DETACH)); err != nil {
		return -1, -1, err
	}
	if err := step("chdir /", unix.Chdir("/")); err != nil {
		return -1, -1, err
	}
	return procSelfFD, exe, nil
}

// chrootIntoShare changes the root to the shared directory. /proc/self/fd
// here is the host's: its fd can reach the host's /proc through "..",
// which the containers this mode is for already hide.
func chrootIntoShare(dir string) (procSelfFD, exe int, err error) {
	procSelfFD, err = unix.Open("/proc/self/fd", unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return -1, -1, fmt.Errorf("sandbox: opening /proc/self/fd: %w", err)
	}
	exe, err = unix.Open("/proc/self/exe", unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, -1, fmt.Errorf("sandbox: opening /proc/self/exe: %w", err)
	}
	if err := unix.Chdir(dir); err != nil {
		return -1, -1, fmt.Errorf("sandbox: chdir %s: %w", dir, err)
	}
	if err := unix.Chroot("."); err != nil {
		return -1, -1, fmt.Errorf("sandbox: chroot %s: %w", dir, err)
	}
	if err := unix.Chdir("/"); err != nil {
		return -1, -1, fmt.Errorf("sandbox: chdir /: %w", err)
	}
	return procSelfFD, exe, nil
}

// execStage replaces the process with stage of the same executable (exe,
// an fd of it: no path of the host is needed), carrying files.
func execStage(exe int, stage string, files map[string]*os.File) error {
	var names []string
	for name, f := range files {
		// Inherited across the exec.
		if _, err := unix.FcntlInt(f.Fd(), unix.F_SETFD, 0); err != nil {
			return fmt.Errorf("sandbox: keeping %s open: %w", name, err)
		}
		names = append(names, name+"="+strconv.Itoa(int(f.Fd())))
	}
	env := append(stageEnv(os.Environ()), envStage+"="+stage, envFiles+"="+strings.Join(names, ","))
	if stage == stageFinal {
		// Go ≥ 1.25 re-reads the cgroup CPU limit every second: not
		// inside the sandbox (no cgroup files, and no syscalls for it).
		env = append(env, "GODEBUG="+strings.TrimPrefix(os.Getenv("GODEBUG")+",updatemaxprocs=0", ","))
	}
	argv, envv, err := execVectors(env)
	if err != nil {
		return err
	}
	empty := [1]byte{}
	_, _, errno := unix.Syscall6(unix.SYS_EXECVEAT, uintptr(exe), uintptr(unsafe.Pointer(&empty[0])),
		uintptr(unsafe.Pointer(&argv[0])), uintptr(unsafe.Pointer(&envv[0])), unix.AT_EMPTY_PATH, 0)
	runtime.KeepAlive(argv)
	runtime.KeepAlive(envv)
	return fmt.Errorf("sandbox: execveat of the %s stage: %w", stage, errno)
}

// resume is the final stage: it checks the capabilities of every thread and
// returns what the daemon needs.
func resume(cfg Config) (*Inside, error) {
	unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0)
	files, err := inherited()
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		unix.CloseOnExec(int(f.Fd()))
	}
	proc := files[fileProcSelfFD]
	if proc == nil {
		return nil, errors.New("sandbox: no /proc/self/fd fd was handed in")
	}
	delete(files, fileProcSelfFD)
	eff, err := effectiveCaps()
	if err != nil {
		return nil, err
	}
	if err := verifyThreads(int(proc.Fd()), eff, cfg.Caps); err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return &Inside{cfg: cfg, root: "/", procSelfFD: proc, files: files}, nil
}

// execVectors are the argv (this process's arguments) and envp (env) of an
// exec of this binary, as the system call takes them.
func execVectors(env []string) (argv, envv []*byte, err error) {
	if argv, err = cStrings(os.Args); err != nil {
		return nil, nil, err
	}
	if envv, err = cStrings(env); err != nil {
		return nil, nil, err
	}
	return argv, envv, nil
}

// cStrings is ss as a NULL-terminated array of NUL-terminated strings.
func cStrings(ss []string) ([]*byte, error) {
	out := make([]*byte, 0, len(ss)+1)
	for _, s := range ss {
		p, err := unix.BytePtrFromString(s)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %q: %w", s, err)
		}
		out = append(out, p)
	}
	return append(out, nil), nil
}

// closeRangeCloexec is CLOSE_RANGE_CLOEXEC (Linux 5.11).
const closeRangeCloexec = 1 << 2

// cloexecFrom marks every fd from first up close-on-exec.
func cloexecFrom(first int) error {
	err := unix.CloseRange(uint(first), ^uint(0), closeRangeCloexec)
	if err == nil {
		return nil
	}
	if err != unix.ENOSYS && err != unix.EINVAL {
		return fmt.Errorf("sandbox: close_range: %w", err)
	}
	// Before Linux 5.11: one by one.
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fmt.Errorf("sandbox: listing inherited fds: %w", err)
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= first {
			unix.CloseOnExec(fd)
		}
	}
	return nil
}
