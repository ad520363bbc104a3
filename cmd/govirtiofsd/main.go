// Command govirtiofsd is a virtio-fs daemon: it shares a host directory with
// a virtual machine over vhost-user. It is a drop-in replacement for the C
// and Rust virtiofsd: QEMU starts it with --socket-path (or libvirt and Kata
// with --fd) and it serves one front-end connection, then exits.
package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/govirtiofsd/govirtiofsd/internal/fuse"
	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
	"github.com/govirtiofsd/govirtiofsd/internal/sandbox"
	"github.com/govirtiofsd/govirtiofsd/internal/vhostuser"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "0.1.0-dev"

func main() {
	// First of all, before the flags are parsed: from here on a SIGTERM,
	// SIGINT or SIGHUP waits in stop until the daemon, or the supervisor
	// of a sandboxed one (sandbox.Config.Signals), reads it, instead of
	// ending the process by the default action. A front end may stop the
	// daemon the moment its socket appears, and the socket and pid file
	// must then go too. A stage of a sandboxed daemon that is its PID
	// namespace's init and gets one before it registers exits with status
	// 2 (the Go runtime's answer to a signal it cannot die of), which the
	// supervisor then takes for the stop it asked for.
	stop := exitSignals()
	if err := newCommand(stop).Execute(); err != nil {
		var exit *sandbox.Exit
		if errors.As(err, &exit) {
			os.Exit(exit.Code) // the sandboxed daemon's status, already reported
		}
		fmt.Fprintln(os.Stderr, "govirtiofsd:", err)
		os.Exit(1)
	}
}

// newCommand returns the command line; stop carries the exit signals
// (exitSignals), nil where the command is only parsed.
func newCommand(stop chan os.Signal) *cobra.Command {
	// announce_submounts is on by default, as in the Rust virtiofsd 1.13:
	// a migration from it carries the setting, and a destination with it
	// off refuses the state.
	o := &Options{FD: -1, Queues: vhostuser.MaxRings - 1, LogLevel: "info", Cache: "auto", InodeFileHandles: "never",
		ThreadPoolSize: -1, RlimitNofile: -1, MigrationMode: "find-paths", MigrationOnError: "abort", AnnounceSubmounts: true}
	cmd := &cobra.Command{
		Use:           "govirtiofsd --socket-path PATH --shared-dir DIR",
		Short:         "virtio-fs daemon: share a host directory with a virtual machine",
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE:          func(cmd *cobra.Command, args []string) error { return run(o, cmd.OutOrStdout(), stop) },
	}
	cmd.SetVersionTemplate("") // -V is ours
	registerFlags(cmd.Flags(), o)
	return cmd
}

// capabilities is the vhost-user back-end capabilities JSON (QEMU's
// docs/interop/vhost-user.json) libvirt reads: "migrate-precopy" means the
// daemon migrates its state with the VM (dirty logging and DEVICE_STATE),
// "separate-options" that the long options are all understood.
const capabilities = `{
  "type": "fs",
  "features": [
    "migrate-precopy",
    "separate-options"
  ]
}`

// Environment of a daemon started by --daemonize (see daemonize).
const (
	envDaemonChild = "GOVIRTIOFSD_DAEMONIZED" // "1" in the background daemon
	childListenFD  = 3                        // the listening socket
	childReadyFD   = 4                        // write end of the readiness pipe
	childLockFD    = 5                        // the pid file lock, with --socket-path
)

func run(o *Options, stdout io.Writer, sigs chan os.Signal) error {
	if o.Version {
		fmt.Fprintf(stdout, "govirtiofsd %s\n", version)
		return nil
	}
	if o.PrintCapabilities {
		fmt.Fprintln(stdout, capabilities)
		return nil
	}
	if err := o.validate(); err != nil {
		return err
	}
	// The first process opens everything outside the share; the stages of
	// a sandboxed daemon (sandbox.Resumed) find it handed in. The first
	// process of a sandboxed daemon, once the daemon has ended
	// (sandbox.Reaped), only reports and removes what it created.
	reaped := sandbox.Reaped()
	first := !sandbox.Resumed() && !reaped
	// The syslog connection is opened first: nothing later may assume
	// /dev/log is reachable (it is not inside a sandbox).
	var syslogConn *net.UnixConn
	if o.Syslog && (first || reaped) {
		c, err := dialSyslog(syslogPath())
		if err != nil {
			// As syslog(3) does, lose nothing: fall back to stderr.
			fmt.Fprintf(os.Stderr, "govirtiofsd: %v; logging to stderr\n", err)
		} else {
			syslogConn = c
			defer c.Close()
		}
	}
	var logTo net.Conn // nil: stderr (not a nil *net.UnixConn)
	if syslogConn != nil {
		logTo = syslogConn
	}
	log, err := newLogger(o.LogLevel, logTo)
	if err != nil {
		return err
	}
	slog.SetDefault(log) // a package handed no logger logs where ours go
	child := os.Getenv(envDaemonChild) == "1"
	if first && o.Daemonize && !child {
		// The --daemonize parent only waits for the daemon to be
		// ready: a signal ends it by the default action. One that came
		// already ends it before it creates anything.
		signal.Stop(sigs)
		select {
		case <-sigs:
			return nil
		default:
		}
		sigs = nil
	}
	if first && (!o.Daemonize || child) {
		for _, n := range o.notes {
			log.Info(n)
		}
	}
	sbcfg, err := sandboxConfig(o, log)
	if err != nil {
		return err
	}
	if reaped {
		return reap(o, sbcfg)
	}
	sbcfg.Signals = sigs

	// The first process creates the sockets and holds the pid lock; it
	// removes them when the daemon is gone: the supervisor of a sandboxed
	// daemon, or the daemon itself with --sandbox none (inside a sandbox
	// the paths would name files of the share).
	var files []sandbox.File
	cleanup := func() {}
	if first {
		if st, err := os.Stat(o.SharedDir); err != nil {
			return fmt.Errorf("shared directory: %w", err)
		} else if !st.IsDir() {
			return fmt.Errorf("shared directory %s is not a directory", o.SharedDir)
		}
		if o.SocketPath != "" {
			// Removed on exit, from wherever we are then.
			if o.SocketPath, err = filepath.Abs(o.SocketPath); err != nil {
				return fmt.Errorf("--socket-path: %w", err)
			}
		}
		created := createdPaths(o, sandbox.WorkDir())
		var ln *net.UnixListener
		var lock *pidLock
		if child {
			os.Unsetenv(envDaemonChild)
			if ln, err = listenerFromFD(childListenFD, "the daemonizing parent's listener"); err != nil {
				return err
			}
			if o.SocketPath != "" {
				lock = &pidLock{f: os.NewFile(childLockFD, "pid-lock"), path: o.SocketPath + ".pid"}
				if err := lock.writePid(); err != nil {
					return err
				}
			}
		} else if ln, lock, err = listen(o); err != nil {
			return err
		}
		if o.Daemonize && !child {
			ln.SetUnlinkOnClose(false) // the background daemon's now
			defer ln.Close()
			return daemonize(ln, lock)
		}
		if lock != nil {
			sbcfg.Keep = append(sbcfg.Keep, lock.f) // held until the daemon is gone
		}
		cleanup = func() { removeCreated(created) }
		defer cleanup()
		// Checked (and raised) here, where the host's paths and
		// CAP_SYS_RESOURCE are still at hand.
		if err := setNofile(o, log); err != nil {
			return err
		}
		if files, err = outsideFiles(o, ln, syslogConn); err != nil {
			return err
		}
		profile, err := profileFiles(sbcfg.Seccomp)
		if err != nil {
			return err
		}
		files = append(files, profile...)
		if child {
			ready, null, relayed, err := relayReady()
			if err != nil {
				return err
			}
			files = append(files, sandbox.File{Name: fileReady, File: ready}, sandbox.File{Name: fileDevNull, File: null})
			sbcfg.Hold = relayed // the supervisor relays until then
		}
	}

	in, err := sandbox.Enter(sbcfg, files)
	if err != nil {
		// In the supervisor, only what went wrong before the daemon
		// was started or the hand-over to its waiter (or *sandbox.Exit:
		// stopped before it was started); the reaped stage, the same
		// process, exits with the daemon's status (reap).
		return err
	}
	if !first {
		if c := handedSyslog(in); c != nil {
			defer c.Close()
			if log, err = newLogger(o.LogLevel, c); err != nil {
				return err
			}
			slog.SetDefault(log)
		}
	}
	ln, err := handedListener(in)
	if err != nil {
		return err
	}
	defer ln.Close()
	metricsLn, err := handedMetrics(in)
	if err != nil {
		return err
	}
	if metricsLn != nil {
		defer metricsLn.Close()
	}

	workers := o.ThreadPoolSize
	if workers < 0 {
		workers = vhostuser.DefaultWorkers()
	}
	fsys, err := newFileSystem(o, in, log)
	if err != nil {
		return err
	}
	fs := fuse.NewServer(fsys, fuse.ServerOptions{Metrics: metricsLn != nil}, log)
	backend, err := vhostuser.NewBackend(vhostuser.Config{
		RequestQueues: o.Queues,
		Tag:           o.Tag,
		Logger:        log,
		Workers:       workers,
		Metrics:       metricsLn != nil,
		State:         fs, // the FUSE session and the file system's inodes and handles migrate
		Handler: vhostuser.HandlerFunc(func(i int) vhostuser.RequestHandler {
			return fs.Queue(i)
		}),
	})
	if err != nil {
		return err
	}

	if metricsLn != nil {
		serveMetrics(metricsLn, &metricsSource{fuse: fs, backend: backend, fs: fsys}, log)
		log.Info("serving metrics", "addr", metricsLn.Addr().String())
	}

	stopProfile, err := startProfiles(in)
	if err != nil {
		return err
	}
	defer stopProfile()

	go func() {
		s := <-sigs
		log.Info("signal received, exiting", "signal", s.String())
		// Without closing the listeners: a failing Accept must not
		// race this exit with an error.
		stopProfile()
		cleanup()
		os.Exit(0)
	}()

	if ready := in.File(fileReady); ready != nil {
		// Set up and about to serve: --daemonize may return. Before
		// the seccomp filter: chdir and dup2 are not on it.
		if err := reportReady(ready, in.File(fileDevNull)); err != nil {
			return err
		}
	}
	if err := in.Lock(log); err != nil {
		return err
	}

	log.Info("waiting for vhost-user connection", "socket", o.SocketPath, "fd", o.FD, "shared_dir", o.SharedDir)
	// The first process removes the socket when the daemon is gone.
	if err := backend.ServeFirst(ln); err != nil {
		return fmt.Errorf("vhost-user: %w", err)
	}
	return nil
}

// reap is the last stage of a sandboxed daemon's first process, the
// supervisor, after the daemon has ended: it reports how (sandbox.Enter
// returns the *sandbox.Exit to exit with) and removes what the first
// process created. It creates nothing: the pid file's lock is still held
// (sandbox.Config.Keep), the socket still there.
func reap(o *Options, cfg sandbox.Config) error {
	_, err := sandbox.Enter(cfg, nil)
	removeCreated(createdPaths(o, sandbox.WorkDir()))
	return err
}

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

// exitSignals registers for the signals that end the daemon; from then on
// they wait in the channel instead of killing the process.
func exitSignals() chan os.Signal {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	return sigs
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

// listen creates the vhost-user socket, holding its pid file lock, or
// adopts an inherited one (lock nil).
func listen(o *Options) (*net.UnixListener, *pidLock, error) {
	if o.FD >= 0 {
		ln, err := listenerFromFD(o.FD, "--fd")
		return ln, nil, err
	}
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

// newLogger logs to stderr, or to syslog when conn is not nil.
func newLogger(level string, conn net.Conn) (*slog.Logger, error) {
	var l slog.Level
	switch strings.ToLower(level) {
	case "trace", "debug":
		l = slog.LevelDebug
	case "info":
		l = slog.LevelInfo
	case "warn", "warning":
		l = slog.LevelWarn
	case "error", "err":
		l = slog.LevelError
	case "off":
		l = slog.LevelError + 100
	default:
		return nil, fmt.Errorf("unknown log level %q", level)
	}
	if conn != nil {
		return slog.New(newSyslogHandler(conn, filepath.Base(os.Args[0]), l)), nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
}

// newFileSystem builds the passthrough file system on the sandbox's view of
// the shared directory and prepares the process for it: supplementary
// groups dropped (CVE-2022-0358).
func newFileSystem(o *Options, in *sandbox.Inside, log *slog.Logger) (*passthrough.FS, error) {
	cache, err := passthrough.ParseCacheMode(o.Cache)
	if err != nil {
		return nil, err
	}
	handles, err := passthrough.ParseFileHandleMode(o.InodeFileHandles)
	if err != nil {
		return nil, err
	}
	onError, err := passthrough.ParseMigrationOnError(o.MigrationOnError)
	if err != nil {
		return nil, err
	}
	migMode, err := passthrough.ParseMigrationMode(o.MigrationMode)
	if err != nil {
		return nil, err
	}
	popts := passthrough.Options{
		Cache:             cache,
		Writeback:         o.Writeback,
		Xattr:             o.Xattr || o.PosixACL,
		XattrMap:          o.XattrMap,
		PosixACL:          o.PosixACL,
		SecurityLabel:     o.SecurityLabel,
		AnnounceSubmounts: o.AnnounceSubmounts,
		NoReaddirplus:     o.NoReaddirplus,
		AllowDirectIO:     o.AllowDirectIO,
		KillprivV2:        o.KillprivV2,
		InodeFileHandles:  handles,
		PosixLocks:        o.PosixLock,
		Flock:             o.Flock,
		ReadOnly:          o.ReadOnly,
		PreserveNoatime:   o.PreserveNoatime,
		ProcSelfFD:        in.ProcSelfFD(),
		Migration: passthrough.MigrationOptions{Mode: migMode, OnError: onError,
			ConfirmPaths: o.MigrationConfirmPaths, VerifyHandles: o.MigrationVerifyHandles},
	}
	if o.Timeout != "" {
		secs, err := strconv.ParseFloat(o.Timeout, 64)
		if err != nil || secs < 0 {
			return nil, fmt.Errorf("-o timeout=%s: want seconds", o.Timeout)
		}
		popts.Timeout, popts.TimeoutSet = time.Duration(secs*float64(time.Second)), true
	}
	if popts.TranslateUID, err = passthrough.NewIDMap(o.TranslateUID); err != nil {
		return nil, fmt.Errorf("--translate-uid: %w", err)
	}
	if popts.TranslateGID, err = passthrough.NewIDMap(o.TranslateGID); err != nil {
		return nil, fmt.Errorf("--translate-gid: %w", err)
	}
	if err := passthrough.DropSupplementaryGroups(); err != nil {
		return nil, err
	}
	return passthrough.New(in.Root(), popts, log)
}

// setNofile applies --rlimit-nofile before the sandbox drops
// CAP_SYS_RESOURCE (the limit is inherited by its stages): not given, raise
// it to the default; N, set exactly N, as the Rust daemon does; 0, leave it.
func setNofile(o *Options, log *slog.Logger) error {
	switch {
	case o.RlimitNofile < 0:
		// min(1,000,000, fs.nr_open), as the Rust daemon: RaiseNofileLimit
		// clamps to fs.nr_open.
		const limit = 1_000_000
		if got, err := passthrough.RaiseNofileLimit(limit); err != nil {
			log.Warn("cannot raise RLIMIT_NOFILE", "want", limit, "have", got, "err", err)
		}
	case o.RlimitNofile > 0:
		if err := passthrough.SetNofileLimit(uint64(o.RlimitNofile)); err != nil {
			return fmt.Errorf("--rlimit-nofile %d: %w", o.RlimitNofile, err)
		}
	}
	return nil
}
