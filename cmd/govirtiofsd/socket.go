package main

import (
	"fmt"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
)

// The vhost-user socket: created at --socket-path, holding its pid file
// lock (pidLock), or adopted from --fd or from the daemonizing parent; and
// the paths the first process removes once the daemon is gone.

// createdPaths are the files the first process creates, in the order it
// removes them once the daemon is gone: the socket, then its pid file
// (while still holding its lock), then a metrics socket. Relative paths
// resolve against dir, where the process was started (sandbox.WorkDir).
func createdPaths(o *Options, dir string) []string {
	var paths []string
	if o.SocketPath != "" && o.FD < 0 {
		sock := absPath(dir, o.SocketPath)
		paths = append(paths, sock, sock+".pid")
	}
	if p := metricsSocketPath(o.MetricsAddr); p != "" {
		paths = append(paths, absPath(dir, p))
	}
	return paths
}

func removeCreated(paths []string) {
	for _, p := range paths {
		os.Remove(p)
	}
}

// absPath resolves p against dir ("": the working directory).
func absPath(dir, p string) string {
	if filepath.IsAbs(p) {
		return p
	}
	if dir == "" {
		if a, err := filepath.Abs(p); err == nil {
			return a
		}
		return p
	}
	return filepath.Join(dir, p)
}

// listenerFromFD adopts an inherited, listening unix socket.
func listenerFromFD(fd int, what string) (*net.UnixListener, error) {
	return unixListener(os.NewFile(uintptr(fd), "vhost-user-listener"), fmt.Sprintf("%s (fd %d)", what, fd))
}

// unixListener wraps f, a listening unix socket, and closes f. The
// listener never removes its path: the process that created the socket
// does (inside a sandbox the path would name a file of the share).
func unixListener(f *os.File, what string) (*net.UnixListener, error) {
	l, err := net.FileListener(f)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		l.Close()
		return nil, fmt.Errorf("%s is not a unix socket", what)
	}
	ul.SetUnlinkOnClose(false)
	return ul, nil
}

// adoptParentListener is the background daemon's listener, and its pid
// file lock with --socket-path, inherited from the daemonizing parent.
func adoptParentListener(o *Options) (*net.UnixListener, *pidLock, error) {
	os.Unsetenv(envDaemonChild)
	ln, err := listenerFromFD(childListenFD, "the daemonizing parent's listener")
	if err != nil {
		return nil, nil, err
	}
	var lock *pidLock
	if o.SocketPath != "" {
		lock = &pidLock{f: os.NewFile(childLockFD, "pid-lock"), path: o.SocketPath + ".pid"}
		if err := lock.writePid(); err != nil {
			return nil, nil, err
		}
	}
	return ln, lock, nil
}

// createSocket creates the vhost-user socket --socket-path names, holding
// its pid file lock.
func createSocket(o *Options) (*net.UnixListener, *pidLock, error) {
	gid := -1
	if o.SocketGroup != "" {
		g, err := lookupGroup(o.SocketGroup)
		if err != nil {
			return nil, nil, fmt.Errorf("--socket-group: %w", err)
		}
		gid = g
	}
	lock, err := lockPidFile(o.SocketPath + ".pid")
	if err != nil {
		return nil, nil, err
	}
	// We hold the lock: a socket left at the path is a stale one.
	if st, err := os.Lstat(o.SocketPath); err == nil && st.Mode()&os.ModeSocket != 0 {
		os.Remove(o.SocketPath)
	}
	mask := 0o177 // the socket is created 0600...
	if gid >= 0 {
		mask = 0o117 // ...or 0660 for its group
	}
	old := syscall.Umask(mask)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: o.SocketPath, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		lock.remove()
		return nil, nil, fmt.Errorf("listen on %s: %w", o.SocketPath, err)
	}
	ln.SetUnlinkOnClose(true)
	if gid >= 0 {
		if err := os.Lchown(o.SocketPath, -1, gid); err != nil {
			ln.Close()
			lock.remove()
			return nil, nil, fmt.Errorf("--socket-group: %w", err)
		}
	}
	return ln, lock, nil
}

// lookupGroup resolves a group name or number.
func lookupGroup(name string) (int, error) {
	if n, err := strconv.ParseUint(name, 10, 31); err == nil {
		return int(n), nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return -1, err
	}
	return strconv.Atoi(g.Gid)
}
