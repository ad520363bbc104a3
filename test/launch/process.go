// Package launch starts the daemons the tests and the benchmarks run —
// govirtiofsd, the reference C virtiofsd and the Rust virtiofsd — and
// watches them: it builds ours, spells each daemon's command line, starts a
// process with its output in a log file, waits for its socket, stops it and
// says how it ended. What exit a harness accepts, and what it checks at the
// end of a test, stays with the harness.
package launch

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// Spec is a process to start with its output in a log file.
type Spec struct {
	Bin   string
	Args  []string
	Env   []string            // added to this process's environment
	Cred  *syscall.Credential // nil: ours
	Files []*os.File          // inherited from fd 3 on; a nil entry is a closed fd
	// Group gives the process a process group of its own, signalled as
	// one (a sandboxed daemon's supervisor and its child go together),
	// and kills it if this process dies first (Pdeathsig).
	Group bool
	// Log takes the process's stdout and stderr: created, or truncated
	// unless Append (several runs in one file). Header starts it with the
	// command line.
	Log            string
	Append, Header bool
}

// Command is the process s describes, its output not routed yet: for a
// caller that runs it to completion, or collects its output itself.
func (s Spec) Command() *exec.Cmd {
	cmd := exec.Command(s.Bin, s.Args...)
	cmd.Env = append(os.Environ(), s.Env...)
	cmd.ExtraFiles = s.Files
	if s.Cred != nil || s.Group {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.Cred, Setpgid: s.Group}
		if s.Group {
			cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
		}
	}
	return cmd
}

// Start starts the process with its output in s.Log.
func (s Spec) Start() (*Process, error) {
	flags := os.O_CREATE | os.O_WRONLY | os.O_TRUNC
	if s.Append {
		flags = os.O_CREATE | os.O_WRONLY | os.O_APPEND
	}
	f, err := os.OpenFile(s.Log, flags, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close() // the process has its own
	cmd := s.Command()
	if s.Header {
		fmt.Fprintf(f, "# %s\n", ShellQuote(cmd.Args))
	}
	cmd.Stdout, cmd.Stderr = f, f
	p, err := Start(cmd)
	if err != nil {
		return nil, err
	}
	p.LogPath = s.Log
	return p, nil
}

// Process is a started process, waited for in the background: it says
// whether it still runs and, once it has ended, how.
type Process struct {
	Cmd *exec.Cmd
	// LogPath is the file holding its output, "" if the caller routed it.
	LogPath string

	group    bool // signals go to its process group
	done     chan struct{}
	err      error     // what Wait returned, set before done closes
	exitTime time.Time // when Wait returned
}

// Start starts cmd and waits for it in the background. A cmd with
// SysProcAttr.Setpgid is signalled as a process group.
func Start(cmd *exec.Cmd) (*Process, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{Cmd: cmd, group: cmd.SysProcAttr != nil && cmd.SysProcAttr.Setpgid, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		p.exitTime = time.Now()
		close(p.done)
	}()
	return p, nil
}

// Pid is the process's id (a sandboxed daemon's supervisor).
func (p *Process) Pid() int { return p.Cmd.Process.Pid }

// Done is closed once the process has ended.
func (p *Process) Done() <-chan struct{} { return p.done }

// Running reports whether the process has not ended yet.
func (p *Process) Running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Wait waits up to timeout for the process to end and reports whether it
// has.
func (p *Process) Wait(timeout time.Duration) bool {
	if timeout <= 0 {
		return !p.Running()
	}
	select {
	case <-p.done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// Err is what waiting for the process returned ("exit status 1", "signal:
// killed"); nil while it runs.
func (p *Process) Err() error {
	if p.Running() {
		return nil
	}
	return p.err
}

// ExitTime is when the process was seen to end; zero while it runs.
func (p *Process) ExitTime() time.Time {
	if p.Running() {
		return time.Time{}
	}
	return p.exitTime
}

// Status is how a process ended.
type Status struct {
	Code   int            // its exit status; -1 if a signal killed it, or it runs
	Signal syscall.Signal // the signal that killed it, else 0
}

// Status is how the process ended; Code -1 while it runs.
func (p *Process) Status() Status {
	if p.Running() {
		return Status{Code: -1}
	}
	ps := p.Cmd.ProcessState
	st := Status{Code: ps.ExitCode()}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		st.Signal = ws.Signal()
	}
	return st
}

// Signal sends sig to the process, or to its process group.
func (p *Process) Signal(sig syscall.Signal) error {
	if p.group {
		return syscall.Kill(-p.Pid(), sig)
	}
	return p.Cmd.Process.Signal(sig)
}

// Step is a stage of Stop: a signal, then how long to wait for the end.
type Step struct {
	Signal syscall.Signal
	Wait   time.Duration
}

// Stop waits up to grace for the process to end by itself, then goes
// through steps, and at last kills it; it returns once the process has
// ended.
func (p *Process) Stop(grace time.Duration, steps ...Step) {
	if p.Wait(grace) {
		return
	}
	for _, s := range steps {
		p.Signal(s.Signal)
		if p.Wait(s.Wait) {
			return
		}
	}
	p.Kill()
}

// Kill kills the process (its group) unless it has ended, and waits for it.
func (p *Process) Kill() {
	if p.Running() {
		p.Signal(syscall.SIGKILL)
		<-p.done
	}
}

// WaitSocket waits up to timeout for a socket at sock, looking every 10
// ms, and fails as soon as the process ends.
func (p *Process) WaitSocket(sock string, timeout time.Duration) error {
	return p.waitFor(sock, timeout, 10*time.Millisecond, func(fi os.FileInfo) bool { return fi.Mode()&os.ModeSocket != 0 })
}

// WaitCreated waits up to timeout for anything at path, looking again
// without a pause: to catch the moment a daemon binds its socket, before it
// listens on it.
func (p *Process) WaitCreated(path string, timeout time.Duration) error {
	return p.waitFor(path, timeout, 0, func(os.FileInfo) bool { return true })
}

func (p *Process) waitFor(path string, timeout, poll time.Duration, ready func(os.FileInfo) bool) error {
	for deadline := time.Now().Add(timeout); ; time.Sleep(poll) {
		if fi, err := os.Lstat(path); err == nil && ready(fi) {
			return nil
		}
		if !p.Running() {
			return fmt.Errorf("%s exited (%v) before creating %s%s", p.Cmd.Path, p.err, path, p.logTail())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: no %s after %v%s", p.Cmd.Path, path, timeout, p.logTail())
		}
	}
}

// logTail is the end of the log for an error message.
func (p *Process) logTail() string {
	if p.LogPath == "" {
		return ""
	}
	return fmt.Sprintf("\nlast lines of %s:\n%s", p.LogPath, p.Tail(30))
}

// Log is the process's output so far ("" without a log file).
func (p *Process) Log() string {
	if p.LogPath == "" {
		return ""
	}
	b, _ := os.ReadFile(p.LogPath)
	return string(b)
}

// Tail is the last n lines of the log.
func (p *Process) Tail(n int) string {
	lines := strings.Split(strings.TrimRight(p.Log(), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
