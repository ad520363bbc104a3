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
	fileSyslog    = "syslog"     // the --syslog connection to /dev/log
	fileReady     = "ready"      // --daemonize: the readiness pipe (relayReady)
	fileDevNull   = "devnull"    // --daemonize: /dev/null for the detached stdio
)

// sandboxConfig builds the sandbox configuration from the options and the
// first process's decision on file handles (decideFileHandles); every
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
	if keepsHandleCaps(o) { // handles.go: decided by the first process
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

// outsideFiles turns everything the daemon needs from outside the shared
// directory into files handed into the sandbox: the vhost-user listener ln
// (closed here), the syslog connection (if any) and the metrics listener,
// bound here. It runs in the first process only; later stages find the
// files handed in.
//
// A file the daemon needs from outside the share is one more entry here and
// one in.File(name) where it is used.
func outsideFiles(o *Options, ln *net.UnixListener, syslogConn *net.UnixConn) ([]sandbox.File, error) {
	var files []sandbox.File
	f, err := listenerFile(ln)
	if err != nil {
		return nil, fmt.Errorf("vhost-user listener: %w", err)
	}
	files = append(files, sandbox.File{Name: fileVhostUser, File: f})
	if syslogConn != nil {
		f, err := syslogConn.File()
		if err != nil {
			return nil, fmt.Errorf("syslog connection: %w", err)
		}
		files = append(files, sandbox.File{Name: fileSyslog, File: f})
	}
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
	return files, nil
}

// handedSyslog returns the syslog connection handed into the sandbox, or
// nil without --syslog.
func handedSyslog(in *sandbox.Inside) net.Conn {
	f := in.File(fileSyslog)
	if f == nil {
		return nil
	}
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		fmt.Fprintf(os.Stderr, "govirtiofsd: syslog connection: %v; logging to stderr\n", err)
		return nil
	}
	return c
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
	return unixListener(f, "vhost-user listener")
}
