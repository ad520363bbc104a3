package main

import (
	"fmt"
	"log/slog"
	"net"
	"os"

	"github.com/govirtiofsd/govirtiofsd/internal/sandbox"
)

// Names of the files handed into the sandbox.
const (
	fileVhostUser = "vhost-user" // the vhost-user listener
	fileMetrics   = "metrics"    // the --metrics-addr listener
)

// sandboxConfig builds the sandbox configuration from the options; every
// stage of the daemon builds the same one.
func sandboxConfig(o *Options, log *slog.Logger) (sandbox.Config, error) {
	cfg := sandbox.Config{SharedDir: o.SharedDir, Log: log}
	var err error
	if cfg.Mode, err = sandbox.ParseMode(o.Sandbox); err != nil {
		return cfg, err
	}
	if cfg.Seccomp, err = sandbox.ParseSeccompMode(o.Seccomp); err != nil {
		return cfg, err
	}
	caps := sandbox.DefaultCaps
	if o.InodeFileHandles == "prefer" || o.InodeFileHandles == "mandatory" {
		caps |= sandbox.FileHandleCaps
	}
	if cfg.Caps, err = sandbox.ParseModcaps(caps, o.Modcaps); err != nil {
		return cfg, err
	}
	for _, s := range o.UIDMaps {
		m, err := sandbox.ParseIDMap(s)
		if err != nil {
			return cfg, fmt.Errorf("--uid-map: %w", err)
		}
		cfg.UIDMaps = append(cfg.UIDMaps, m)
	}
	for _, s := range o.GIDMaps {
		m, err := sandbox.ParseIDMap(s)
		if err != nil {
			return cfg, fmt.Errorf("--gid-map: %w", err)
		}
		cfg.GIDMaps = append(cfg.GIDMaps, m)
	}
	return cfg, nil
}

// enterSandbox opens everything the daemon needs outside the shared
// directory — in the first process only: later stages find it handed in —
// and confines the process. It returns in the process that serves; the
// supervisor of a sandboxed daemon gets *sandbox.Exit once the daemon is
// gone.
//
// A file the daemon needs from outside the share is one more entry in
// files here and one in.File(name) where it is used.
func enterSandbox(o *Options, cfg sandbox.Config) (*sandbox.Inside, error) {
	var files []sandbox.File
	if !sandbox.Resumed() {
		ln, err := listen(o)
		if err != nil {
			return nil, err
		}
		f, err := ln.File()
		// The path stays: the supervisor (or, with --sandbox none, the
		// daemon once connected) removes it.
		ln.SetUnlinkOnClose(false)
		ln.Close()
		if err != nil {
			return nil, fmt.Errorf("vhost-user listener: %w", err)
		}
		files = append(files, sandbox.File{Name: fileVhostUser, File: f})
		if o.MetricsAddr != "" {
			ml, err := listenMetrics(o.MetricsAddr)
			if err != nil {
				return nil, err
			}
			f, err := listenerFile(ml)
			if err != nil {
				return nil, fmt.Errorf("metrics listener: %w", err)
			}
			files = append(files, sandbox.File{Name: fileMetrics, File: f})
		}
	}
	in, err := sandbox.Enter(cfg, files)
	if in == nil && !sandbox.Resumed() {
		// The supervisor, once the daemon is gone (or could not be
		// started), removes the sockets it created.
		if o.SocketPath != "" {
			os.Remove(o.SocketPath)
		}
		if p := metricsSocketPath(o.MetricsAddr); p != "" {
			os.Remove(p)
		}
	}
	return in, err
}

// listenerFile returns ln's socket as a file and closes ln, leaving a unix
// socket's path in place (the process that created it removes it).
func listenerFile(ln net.Listener) (*os.File, error) {
	type filer interface{ File() (*os.File, error) }
	if ul, ok := ln.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	defer ln.Close()
	fl, ok := ln.(filer)
	if !ok {
		return nil, fmt.Errorf("%T has no file", ln)
	}
	return fl.File()
}

// handedMetrics wraps the metrics listener handed into the sandbox, or
// returns nil without --metrics-addr. Like handedListener it must run before
// the seccomp filter is loaded.
func handedMetrics(in *sandbox.Inside) (net.Listener, error) {
	f := in.File(fileMetrics)
	if f == nil {
		return nil, nil
	}
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("metrics listener: %w", err)
	}
	if ul, ok := l.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false) // never by path: inside a sandbox it names a file of the share
	}
	return l, nil
}

// handedListener wraps the vhost-user listener handed into the sandbox. It
// must run before the seccomp filter is loaded (net.FileListener calls
// getsockopt).
func handedListener(in *sandbox.Inside) (*net.UnixListener, error) {
	f := in.File(fileVhostUser)
	if f == nil {
		return nil, fmt.Errorf("no vhost-user listener was handed into the sandbox")
	}
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("vhost-user listener: %w", err)
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		l.Close()
		return nil, fmt.Errorf("vhost-user listener is not a unix socket")
	}
	ul.SetUnlinkOnClose(false) // never by path: inside a sandbox it names a file of the share
	return ul, nil
}
