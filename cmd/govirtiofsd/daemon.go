package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// pidLock is the <socket>.pid file a daemon creating its socket holds an
// exclusive flock on while it runs, so that a second daemon on the same
// socket path is refused instead of stealing the socket. It holds the pid.
type pidLock struct {
	f    *os.File
	path string
}

// lockPidFile creates (or reuses) path and locks it, or reports the daemon
// holding it.
func lockPidFile(path string) (*pidLock, error) {
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return nil, fmt.Errorf("pid file: %w", err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			pid, _ := io.ReadAll(io.LimitReader(f, 32))
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, fmt.Errorf("another daemon (pid %s) is serving %s: %s is locked",
					trimPid(pid), path[:len(path)-len(".pid")], path)
			}
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		// The daemon we waited for may have removed the file after we
		// opened it: a lock on an unlinked file protects nothing.
		var a, b unix.Stat_t
		if unix.Fstat(int(f.Fd()), &a) == nil && unix.Stat(path, &b) == nil && a.Ino == b.Ino && a.Dev == b.Dev {
			l := &pidLock{f: f, path: path}
			if err := l.writePid(); err != nil {
				f.Close()
				return nil, err
			}
			return l, nil
		}
		f.Close()
	}
}

func trimPid(b []byte) string {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == ' ') {
		b = b[:len(b)-1]
	}
	if len(b) == 0 {
		return "?"
	}
	return string(b)
}

// writePid records our pid in the locked file.
func (l *pidLock) writePid() error {
	err := l.f.Truncate(0)
	if err == nil {
		_, err = l.f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	if err != nil {
		return fmt.Errorf("pid file %s: %w", l.path, err)
	}
	return nil
}

// remove deletes the pid file while still holding the lock (a nil lock is
// a no-op).
func (l *pidLock) remove() {
	if l == nil {
		return
	}
	os.Remove(l.path)
}

// daemonize starts the daemon in the background and returns when it is
// ready to serve. Go cannot fork, so the daemon is this binary again, with
// the same arguments, in a new session: it inherits the listening socket
// (which exists before this process exits, so whoever ran us may connect
// at once), the pid file lock, and a pipe on which it says "ready" once
// its file system is set up, or on which this process reads end-of-file
// when it failed (its error goes to our stderr until it is ready). The C
// virtiofsd forks only after its front end connected; returning once the
// socket listens is what a caller that starts the VMM next needs.
func daemonize(ln *net.UnixListener, lock *pidLock) error {
	ln.SetUnlinkOnClose(false) // the background daemon's now
	defer ln.Close()
	lf, err := ln.File()
	if err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	defer lf.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	defer r.Close()
	files := []*os.File{lf, w}
	if lock != nil {
		files = append(files, lock.f)
	}
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), envDaemonChild+"=1")
	cmd.ExtraFiles = files
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	w.Close()
	if err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	msg, _ := io.ReadAll(io.LimitReader(r, 16))
	if string(msg) != "ready\n" {
		err := cmd.Wait()
		return fmt.Errorf("the background daemon failed to start (%v)", err)
	}
	cmd.Process.Release()
	return nil
}

// relayReady is the background daemon's side of --daemonize, in its first
// process. It returns the write end of a pipe to hand to the process that
// serves (the sandboxed daemon, or this one with --sandbox none), the
// /dev/null it detaches onto, and a channel closed when the relay is done.
// When that process reports ready, the relay tells the daemonizing parent
// and detaches this process too; if the pipe closes without it, the parent
// sees its pipe close and reports a failure.
func relayReady() (ready, null *os.File, done <-chan struct{}, err error) {
	parent := os.NewFile(childReadyFD, "ready")
	r, w, err := os.Pipe()
	if err != nil {
		parent.Close()
		return nil, nil, nil, fmt.Errorf("daemonize: %w", err)
	}
	if null, err = os.OpenFile(os.DevNull, os.O_RDWR, 0); err != nil {
		parent.Close()
		r.Close()
		w.Close()
		return nil, nil, nil, fmt.Errorf("daemonize: %w", err)
	}
	relayed := make(chan struct{})
	go func() {
		defer close(relayed)
		defer parent.Close()
		msg, _ := io.ReadAll(io.LimitReader(r, 16))
		r.Close()
		if string(msg) != "ready\n" {
			return
		}
		if _, err := parent.WriteString("ready\n"); err == nil {
			detachStdio(nil)
		}
	}()
	return w, null, relayed, nil
}

// reportReady ends the background daemon's start-up in the process that
// serves: it reports ready through the relay and moves its stdio to null
// (handed in: a sandbox has no /dev).
func reportReady(ready, null *os.File) error {
	_, err := ready.WriteString("ready\n")
	ready.Close()
	if err != nil {
		return fmt.Errorf("daemonize: report ready: %w", err)
	}
	return detachStdio(null)
}

// detachStdio moves to / and points stdin, stdout and stderr at null
// (nil: open /dev/null).
func detachStdio(null *os.File) error {
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	if null == nil {
		var err error
		if null, err = os.OpenFile(os.DevNull, os.O_RDWR, 0); err != nil {
			return fmt.Errorf("daemonize: %w", err)
		}
	}
	defer null.Close()
	for fd := 0; fd <= 2; fd++ {
		if err := unix.Dup3(int(null.Fd()), fd, 0); err != nil {
			return fmt.Errorf("daemonize: %w", err)
		}
	}
	return nil
}
