package sandbox

// The supervisor's waiting, in C (waiter.c). Once the sandboxed daemon
// runs, the supervisor has nothing left to do but pass stop signals on to
// it and wait for it to end, and a Go process doing nothing still holds
// about a megabyte of anonymous memory. So it hands its waiting over: it
// execs itself as the wait stage, which a constructor in waiter.c takes
// before the Go runtime starts, and which execs the Go reaped stage once
// the daemon is gone (reaped, below): the supervisor's reports, its exit
// status, and the caller's clean-up (the socket and the pid file it
// removes) come from there. It is the same process throughout: the
// daemon's parent, holding what the supervisor kept open (Config.Keep).
//
// The hand-over loses no stop signal. One that came before is in Go's
// hands, on its way to the supervisor's channel, and is passed on; one that
// comes after is pending, blocked, on the thread that execs, and pending
// signals survive an exec (handOver says how).

/*
#include "waiter.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	envStage    = C.ENV_STAGE
	stageWait   = C.STAGE_WAIT
	stageReaped = C.STAGE_REAPED

	envComm    = C.ENV_COMM
	envPID     = C.ENV_PID
	envResend  = C.ENV_RESEND
	envGrace   = C.ENV_GRACE
	envStatus  = C.ENV_STATUS
	envStop    = C.ENV_STOP
	envKilled  = C.ENV_KILLED
	envWorkDir = "GOVIRTIOFSD_SANDBOX_WORKDIR" // the supervisor's, for Reaped's callers (WorkDir)
)

// goSignalExit is the status a Go program exits with when a signal it has
// not registered for would end it and cannot: the runtime's handler
// re-raises the signal with the default action, which the kernel drops for
// the init of a PID namespace, and then calls exit(2).
const goSignalExit = C.GO_SIGNAL_EXIT

// A stop signal passed on to the daemon is repeated every stopResend until
// the daemon is gone, and after stopGrace the daemon is killed. Repeated,
// because it can be lost: in the namespace sandbox the daemon is the init
// of its PID namespace, and the kernel drops a signal sent to such a
// process while it has no handler for it, as it has none between the
// execs of its stages. Killed, because a daemon that does not exit when
// told would keep its guest's requests and the socket's name. The waiter
// gets them from the supervisor; variables for tests.
var (
	stopResend = 20 * time.Millisecond
	stopGrace  = 5 * time.Second
)

// handOver replaces the supervisor, which started the daemon pid from
// this (locked) thread, by the waiter; it returns only if the exec fails.
// sigs is the supervisor's channel of stop signals, and first one taken
// from it already (nil if none). dir is the working directory the
// supervisor started in.
//
// The exec must happen on the thread that started the daemon: the daemon's
// parent-death signal fires when that thread ends, and an exec ends every
// thread but the one that calls it.
func handOver(cfg Config, pid int, sigs <-chan os.Signal, first os.Signal, dir string) error {
	// Before anything: os/signal's calls reset the mask of a thread of
	// its own.
	flush := make(chan os.Signal, 1)
	signal.Notify(flush, syscall.Signal(C.HANDOVER_FLUSH))
	// From here on a stop signal ends up pending, blocked, on this
	// thread, or for the process while every thread blocks it
	// (waiter.c).
	if C.sandbox_handover_begin() != 0 {
		return errors.New("sandbox: handing the stop signals over failed")
	}
	C.sandbox_handover_sweep() // best effort: a thread that does not answer within a second is given up
	tid := unix.Gettid()
	pass := func(s os.Signal) {
		if sig, ok := s.(syscall.Signal); ok {
			unix.Tgkill(os.Getpid(), tid, sig)
		}
	}
	if first != nil {
		pass(first)
	}
	// One that came before is in Go's hands: let it reach sigs. Go hands
	// the signals it caught to os/signal in increasing order, so once
	// HANDOVER_FLUSH, numbered above them all, is through, so is any of
	// them Go's handler took (the sweep waited for every handler).
	unix.Kill(os.Getpid(), syscall.Signal(C.HANDOVER_FLUSH))
	select {
	case <-flush:
	case <-time.After(time.Second): // never; but do not hang the daemon's parent
	}
	for drained := false; !drained; {
		select {
		case s := <-sigs:
			pass(s)
		default:
			drained = true
		}
	}

	// Nothing crosses but stdio and what the caller keeps.
	if err := cloexecFrom(3); err != nil {
		return err
	}
	for _, f := range cfg.Keep {
		if _, err := unix.FcntlInt(f.Fd(), unix.F_SETFD, 0); err != nil {
			return fmt.Errorf("sandbox: keeping %s open: %w", f.Name(), err)
		}
	}
	comm, _ := os.ReadFile("/proc/self/comm")
	env := append(stageEnv(os.Environ()), envStage+"="+stageWait, envPID+"="+strconv.Itoa(pid),
		envComm+"="+strings.TrimSuffix(string(comm), "\n"),
		envResend+"="+strconv.FormatInt(stopResend.Milliseconds(), 10),
		envGrace+"="+strconv.FormatInt(stopGrace.Milliseconds(), 10),
		envWorkDir+"="+dir)
	argv, envv, err := execVectors(env)
	if err != nil {
		return err
	}
	exe := []byte("/proc/self/exe\x00")
	// Threads the runtime started since the sweep block the stop
	// signals too; then nothing but the exec system call itself.
	C.sandbox_handover_end()
	_, _, errno := unix.RawSyscall(unix.SYS_EXECVE, uintptr(unsafe.Pointer(&exe[0])),
		uintptr(unsafe.Pointer(&argv[0])), uintptr(unsafe.Pointer(&envv[0])))
	runtime.KeepAlive(argv)
	runtime.KeepAlive(envv)
	return fmt.Errorf("sandbox: exec of the waiter: %w", errno)
}

func init() {
	switch os.Getenv(envStage) {
	case "":
		// The supervisor starts the daemon and execs the waiter from
		// the main thread, the one whose id is the process's: an exec
		// from another thread takes over that id and ends the main
		// thread, and meanwhile /proc/PID shows a process with no
		// root and no children. The main goroutine stays on the main
		// thread if an init locks it (runtime.LockOSThread); Enter
		// lets go with --sandbox none, where the first process serves.
		runtime.LockOSThread()
	case stageReaped:
		// The waiter execs the reaped stage with the stop signals
		// ignored, and the Go runtime keeps that for SIGINT and
		// SIGHUP, not SIGTERM: its handler would end the process at
		// one that came before the caller registers (as it does first
		// thing), leaving the socket behind. As early as Go code
		// runs, ignore it again.
		signal.Ignore(syscall.SIGTERM)
	}
}

// Reaped reports whether this process is the reaped stage: the supervisor
// of a sandboxed daemon that has ended. Enter reports how it ended and
// returns its *Exit; the caller removes what its first process created
// (it keeps what Config.Keep held, still open) and creates nothing.
func Reaped() bool { return os.Getenv(envStage) == stageReaped }

// WorkDir is the working directory the process was started in, against
// which its command line's relative paths resolve: in the reaped stage the
// supervisor's (--daemonize moved to / since), elsewhere the current one;
// "" if unknown.
func WorkDir() string {
	if dir := os.Getenv(envWorkDir); dir != "" && Reaped() {
		return dir
	}
	dir, _ := os.Getwd()
	return dir
}

// reaped is Enter in the reaped stage: it reports how the daemon ended, as
// the waiter saw it, and returns the supervisor's exit status (exitCode).
func reaped(cfg Config) (int, error) {
	pid, err := strconv.Atoi(os.Getenv(envPID))
	if err != nil {
		return 0, fmt.Errorf("sandbox: %s=%q", envPID, os.Getenv(envPID))
	}
	raw, err1 := strconv.Atoi(os.Getenv(envStatus))
	stop, err2 := strconv.Atoi(os.Getenv(envStop))
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("sandbox: the waiter's report: %w", err)
	}
	if raw == -1 {
		return 0, fmt.Errorf("sandbox: the waiter lost the daemon (pid %d)", pid)
	}
	ws, sig := syscall.WaitStatus(raw), syscall.Signal(stop)
	if os.Getenv(envKilled) == "1" {
		grace, _ := strconv.Atoi(os.Getenv(envGrace))
		cfg.Log.Warn("sandboxed daemon did not stop; killing it", "pid", pid,
			"signal", sig.String(), "after", time.Duration(grace)*time.Millisecond)
	}
	switch {
	case stoppedAsAsked(ws, sig):
		cfg.Log.Debug("sandboxed daemon stopped", "pid", pid, "status", statusString(ws))
	case ws.Signaled():
		msg := "sandboxed daemon killed by signal " + unix.SignalName(ws.Signal())
		if ws.Signal() == syscall.SIGSYS {
			msg += ": a system call outside the seccomp allowlist (find it with --seccomp log or trap)"
		}
		cfg.Log.Error(msg, "pid", pid)
	}
	return exitCode(ws, sig), nil
}

// stoppedAsAsked reports whether the daemon, told to stop by the signal
// stop (0: not told), ended as asked though not by its own handler: killed
// by the signal passed on before it had one, or by the waiter's SIGKILL,
// or, as its PID namespace's init, ended by the Go runtime's answer to a
// signal that came before it registered. A seccomp kill is never asked
// for.
func stoppedAsAsked(ws syscall.WaitStatus, stop syscall.Signal) bool {
	return stop != 0 && (ws.Signaled() && ws.Signal() != syscall.SIGSYS || ws.Exited() && ws.ExitStatus() == goSignalExit)
}

// exitCode is the supervisor's exit status for a daemon that ended with
// ws: 0 if it stopped as asked, 128+n if killed by signal n, else its exit
// status. (sandbox_exit_code in waiter.c is the same.)
func exitCode(ws syscall.WaitStatus, stop syscall.Signal) int {
	switch {
	case stoppedAsAsked(ws, stop):
		return 0
	case ws.Signaled():
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}

// statusString is os.ProcessState.String of ws.
func statusString(ws syscall.WaitStatus) string {
	var s string
	switch {
	case ws.Exited():
		s = "exit status " + strconv.Itoa(ws.ExitStatus())
	case ws.Signaled():
		s = "signal: " + ws.Signal().String()
	}
	if ws.CoreDump() {
		s += " (core dumped)"
	}
	return s
}

// waiterExitCode is the C waiter's fallback exit status (tests hold it to
// reaped's).
func waiterExitCode(status syscall.WaitStatus, stop syscall.Signal) int {
	return int(C.sandbox_exit_code(C.int(status), C.int(stop)))
}
