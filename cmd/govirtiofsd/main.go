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
	o := newOptions()
	cmd := &cobra.Command{
		Use:           "govirtiofsd --socket-path PATH --shared-dir DIR",
		Short:         "virtio-fs daemon: share a host directory with a virtual machine",
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		PreRunE:       func(*cobra.Command, []string) error { return o.validate() },
		RunE:          func(cmd *cobra.Command, _ []string) error { return run(o, cmd.OutOrStdout(), stop) },
	}
	registerFlags(cmd.Flags(), o)
	cmd.SetFlagErrorFunc(flagError)
	cmd.SetUsageFunc(usageFunc(o))
	return cmd
}

// capabilities is the vhost-user back-end capabilities JSON (QEMU's
// docs/interop/vhost-user.json) libvirt reads: "migrate-precopy" means the
// daemon migrates its state with the VM (dirty logging and DEVICE_STATE),
// "separate-options" that the long options are all understood, and the two
// "-negotiation-mode" features (the Rust virtiofsd 1.14's) that
// --posix-acl and --security-label take never, auto or always.
const capabilities = `{
  "type": "fs",
  "features": [
    "migrate-precopy",
    "posix-acl-negotiation-mode",
    "security-label-negotiation-mode",
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

// run is the daemon, stage by stage. Every process of it runs the same
// command line (the sandbox's stages and --daemonize start this binary
// again); process says which does what. The first process opens
// everything outside the share; inside the sandbox a stage builds the file
// system, the FUSE server on it and the vhost-user back end, and serves
// one front end.
func run(o *Options, stdout io.Writer, sigs chan os.Signal) error {
	if o.Version || o.PrintCapabilities {
		printInfo(o, stdout)
		return nil
	}
	d := &daemon{o: o, proc: thisProcess(o)}
	if err := d.startLogging(); err != nil {
		return err
	}
	defer d.closeSyslog()
	if d.proc.parent {
		return d.startInBackground(sigs)
	}
	d.logNotes()
	if err := d.decideFileHandles(); err != nil {
		return err
	}
	var err error
	if d.sandbox, err = sandboxConfig(o, d.log); err != nil {
		return err
	}
	if d.proc.reaped {
		return reap(o, d.sandbox)
	}
	d.sandbox.Signals = sigs

	files, cleanup, err := d.openOutside()
	defer cleanup()
	if err != nil {
		return err
	}
	in, err := sandbox.Enter(d.sandbox, files)
	if err != nil {
		// In the supervisor, only what went wrong before the daemon
		// was started or the hand-over to its waiter (or *sandbox.Exit:
		// stopped before it was started); the reaped stage, the same
		// process, exits with the daemon's status (reap).
		return err
	}
	h, err := d.takeHanded(in)
	if err != nil {
		return err
	}
	defer h.close()

	fileSystem, err := newFileSystem(o, in, d.log)
	if err != nil {
		return err
	}
	server := fuse.NewServer(fileSystem, fuse.ServerOptions{Metrics: h.metrics != nil}, d.log)
	backend, err := d.newBackend(server, h.metrics != nil)
	if err != nil {
		return err
	}
	fileSystem.SetWindow(backend.Window()) // nil without --cache-size
	if h.metrics != nil {
		serveMetrics(h.metrics, &metricsSource{server: server, backend: backend, fileSystem: fileSystem}, d.log)
	}
	return d.serve(in, backend, h.listener, sigs, cleanup)
}

// printInfo answers -V and --print-capabilities. With a DAX window
// (--cache-size) the daemon cannot migrate: QEMU blocks it, and the
// back end does not offer DEVICE_STATE.
func printInfo(o *Options, stdout io.Writer) {
	if o.Version {
		fmt.Fprintf(stdout, "govirtiofsd %s\n", version)
		return
	}
	if o.CacheSize > 0 {
		fmt.Fprintln(stdout, strings.Replace(capabilities, "    \"migrate-precopy\",\n", "", 1))
		return
	}
	fmt.Fprintln(stdout, capabilities)
}

// process says which of the daemon's processes this one is.
type process struct {
	// first was started by the launcher's command line (or by
	// --daemonize): it opens everything outside the share. The stages of
	// a sandboxed daemon (sandbox.Resumed) find it handed in.
	first bool
	// background is the first process of the daemon --daemonize started.
	background bool
	// parent is the first process of a --daemonize command: it starts the
	// background daemon and returns once that is ready.
	parent bool
	// reaped is the first process of a sandboxed daemon again, once the
	// daemon has ended (sandbox.Reaped): it only reports and removes what
	// it created.
	reaped bool
}

func thisProcess(o *Options) process {
	reaped := sandbox.Reaped()
	first := !sandbox.Resumed() && !reaped
	background := first && os.Getenv(envDaemonChild) == "1"
	return process{first: first, background: background, parent: first && o.Daemonize && !background, reaped: reaped}
}

// daemon is what run's stages share.
type daemon struct {
	o       *Options
	proc    process
	log     *slog.Logger
	syslog  *net.UnixConn // --syslog's connection, opened by the first (and reaped) process
	sandbox sandbox.Config
}

// startLogging opens the log. The syslog connection is opened first:
// nothing later may assume /dev/log is reachable (it is not inside a
// sandbox, where a stage finds the connection handed in: takeHanded).
func (d *daemon) startLogging() error {
	if d.o.Syslog && (d.proc.first || d.proc.reaped) {
		c, err := dialSyslog(syslogPath())
		if err != nil {
			// As syslog(3) does, lose nothing: fall back to stderr.
			fmt.Fprintf(os.Stderr, "govirtiofsd: %v; logging to stderr\n", err)
		} else {
			d.syslog = c
		}
	}
	var logTo net.Conn // nil: stderr (not a nil *net.UnixConn)
	if d.syslog != nil {
		logTo = d.syslog
	}
	log, err := newLogger(d.o.LogLevel, logTo)
	if err != nil {
		d.closeSyslog()
		return err
	}
	d.log = log
	slog.SetDefault(log) // a package handed no logger logs where ours go
	return nil
}

func (d *daemon) closeSyslog() {
	if d.syslog != nil {
		d.syslog.Close()
	}
}

// logNotes logs the options given that have no effect here, in the
// process that serves or supervises (not the --daemonize parent: its
// background daemon does).
func (d *daemon) logNotes() {
	if d.proc.first && !d.proc.parent {
		for _, n := range d.o.notes {
			d.log.Info(n)
		}
	}
}

// startInBackground is the --daemonize command: it creates the socket,
// starts the background daemon on it and returns once that is ready. It
// only waits, so a stop signal ends it by the default action; one that
// came already ends it before it creates anything.
func (d *daemon) startInBackground(sigs chan os.Signal) error {
	signal.Stop(sigs)
	select {
	case <-sigs:
		return nil
	default:
	}
	// The background daemon's checks, made here too: they fail the command.
	if _, err := sandboxConfig(d.o, d.log); err != nil {
		return err
	}
	ln, lock, err := d.listen()
	if err != nil {
		return err
	}
	return daemonize(ln, lock)
}

// openOutside is the first process's stage before the sandbox: it listens
// and opens the files the daemon needs from outside the share, which
// later stages find handed in. cleanup removes what it created once the
// daemon is gone; it runs in the first process: the supervisor of a
// sandboxed daemon, or the daemon itself with --sandbox none (inside a
// sandbox the paths would name files of the share).
func (d *daemon) openOutside() (files []sandbox.File, cleanup func(), err error) {
	cleanup = func() {}
	if !d.proc.first {
		return nil, cleanup, nil
	}
	ln, lock, err := d.listen()
	if err != nil {
		return nil, cleanup, err
	}
	if lock != nil {
		d.sandbox.Keep = append(d.sandbox.Keep, lock.f) // held until the daemon is gone
	}
	created := createdPaths(d.o, sandbox.WorkDir())
	cleanup = func() { removeCreated(created) }
	// Set here, where the host's paths and CAP_SYS_RESOURCE are still at
	// hand; the sandbox's stages inherit the limit.
	if err := setNofile(d.o, d.log); err != nil {
		return nil, cleanup, err
	}
	if files, err = outsideFiles(d.o, ln, d.syslog); err != nil {
		return nil, cleanup, err
	}
	profile, err := profileFiles(d.sandbox.Seccomp)
	if err != nil {
		return nil, cleanup, err
	}
	files = append(files, profile...)
	if d.proc.background {
		ready, null, relayed, err := relayReady()
		if err != nil {
			return nil, cleanup, err
		}
		files = append(files, sandbox.File{Name: fileReady, File: ready}, sandbox.File{Name: fileDevNull, File: null})
		d.sandbox.Hold = relayed // the supervisor relays until then
	}
	return files, cleanup, nil
}

// listen checks the shared directory and creates the vhost-user socket
// (holding its pid file lock), or adopts the listener --fd or the
// daemonizing parent hands in.
func (d *daemon) listen() (*net.UnixListener, *pidLock, error) {
	o := d.o
	if st, err := os.Stat(o.SharedDir); err != nil {
		return nil, nil, fmt.Errorf("shared directory: %w", err)
	} else if !st.IsDir() {
		return nil, nil, fmt.Errorf("shared directory %s is not a directory", o.SharedDir)
	}
	if o.SocketPath != "" {
		// Removed on exit, from wherever we are then.
		var err error
		if o.SocketPath, err = filepath.Abs(o.SocketPath); err != nil {
			return nil, nil, fmt.Errorf("--socket-path: %w", err)
		}
	}
	switch {
	case d.proc.background:
		return adoptParentListener(o)
	case o.FD >= 0:
		ln, err := listenerFromFD(o.FD, "--fd")
		return ln, nil, err
	}
	return createSocket(o)
}

// handed is what the first process opened outside the share, as the
// process that serves finds it.
type handed struct {
	syslog   net.Conn // a sandbox stage's --syslog connection (the first process has d.syslog)
	listener *net.UnixListener
	metrics  net.Listener // nil without --metrics-addr
}

// takeHanded takes the files handed into the sandbox, and logs to syslog
// through the connection handed in. It runs before the seccomp filter is
// loaded (net.FileListener calls getsockopt).
func (d *daemon) takeHanded(in *sandbox.Inside) (h handed, err error) {
	defer func() {
		if err != nil {
			h.close()
		}
	}()
	if !d.proc.first {
		if h.syslog = handedSyslog(in); h.syslog != nil {
			if d.log, err = newLogger(d.o.LogLevel, h.syslog); err != nil {
				return h, err
			}
			slog.SetDefault(d.log)
		}
	}
	if h.listener, err = handedListener(in); err != nil {
		return h, err
	}
	h.metrics, err = handedMetrics(in)
	return h, err
}

func (h handed) close() {
	if h.metrics != nil {
		h.metrics.Close()
	}
	if h.listener != nil {
		h.listener.Close()
	}
	if h.syslog != nil {
		h.syslog.Close()
	}
}

// newBackend makes the vhost-user back end that feeds server the guest's
// requests and migrates its state.
func (d *daemon) newBackend(server *fuse.Server, metrics bool) (*vhostuser.Backend, error) {
	workers := d.o.ThreadPoolSize
	if workers < 0 {
		workers = defaultWorkers()
	}
	return vhostuser.NewBackend(vhostuser.Config{
		RequestQueues: d.o.Queues,
		Tag:           d.o.Tag,
		Logger:        d.log,
		Workers:       workers,
		Metrics:       metrics,
		CacheSize:     d.o.CacheSize, // 0: no DAX window, nothing changes
		State:         server,        // the FUSE session and the file system's inodes and handles migrate (not with a window)
		RingsWatched:  reserveWatcherProcs,
		Handler: vhostuser.HandlerFunc(func(i int) vhostuser.RequestHandler {
			return server.Queue(i)
		}),
	})
}

// serve answers the front end on ln until it goes away. A stop signal
// ends the process at once, after cleanup (the first process's: removing
// what it created).
func (d *daemon) serve(in *sandbox.Inside, backend *vhostuser.Backend, ln *net.UnixListener, sigs chan os.Signal, cleanup func()) error {
	stopProfile, err := startProfiles(in)
	if err != nil {
		return err
	}
	defer stopProfile()
	log := d.log
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
	log.Info("waiting for vhost-user connection", "socket", d.o.SocketPath, "fd", d.o.FD, "shared_dir", d.o.SharedDir)
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

// exitSignals registers for the signals that end the daemon; from then on
// they wait in the channel instead of killing the process.
func exitSignals() chan os.Signal {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	return sigs
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
	handles, err := fileHandleMode(o)
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
	// ACLs, labels and an xattr map imply --xattr, as in the Rust daemon.
	acl, label := o.PosixACL != passthrough.NegotiateNever, o.SecurityLabel != passthrough.NegotiateNever
	popts := passthrough.Options{
		InodeDAX:          o.InodeDAX,
		Cache:             cache,
		Writeback:         o.Writeback,
		Xattr:             o.Xattr || acl || label || o.XattrMap != "",
		XattrMap:          o.XattrMap,
		PosixACL:          acl,
		SecurityLabel:     label,
		AnnounceSubmounts: o.AnnounceSubmounts,
		NoReaddirplus:     o.NoReaddirplus,
		AllowDirectIO:     o.AllowDirectIO,
		KillprivV2:        o.KillprivV2,
		InodeFileHandles:  handles,
		InodeFDBudget:     o.InodeFDBudget, // 0: half the RLIMIT_NOFILE setNofile left
		PosixLocks:        o.PosixLock,
		Flock:             o.Flock,
		ReadOnly:          o.ReadOnly,
		PreserveNoatime:   o.PreserveNoatime,
		ProcSelfFD:        in.ProcSelfFD(),
		Migration: passthrough.MigrationOptions{Mode: migMode, OnError: onError,
			ConfirmPaths: o.MigrationConfirmPaths, VerifyHandles: o.MigrationVerifyHandles},
	}
	popts.RequirePosixACL = o.PosixACL == passthrough.NegotiateAlways
	popts.RequireSecurityLabel = o.SecurityLabel == passthrough.NegotiateAlways
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
	logFileHandles(o, log)
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
