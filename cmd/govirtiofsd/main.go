// Command govirtiofsd is a virtio-fs daemon: it shares a host directory with
// a virtual machine over vhost-user. It is a drop-in replacement for the C
// and Rust virtiofsd: QEMU starts it with --socket-path (or libvirt and Kata
// with --fd) and it serves one front-end connection, then exits.
package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime"
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
	if err := newCommand().Execute(); err != nil {
		var exit *sandbox.Exit
		if errors.As(err, &exit) {
			os.Exit(exit.Code) // the sandboxed daemon's status, already reported
		}
		fmt.Fprintln(os.Stderr, "govirtiofsd:", err)
		os.Exit(1)
	}
}

func newCommand() *cobra.Command {
	o := &Options{FD: -1, Queues: vhostuser.MaxRings - 1, LogLevel: "info", Cache: "auto", InodeFileHandles: "never", ThreadPoolSize: -1, RlimitNofile: -1}
	cmd := &cobra.Command{
		Use:           "govirtiofsd --socket-path PATH --shared-dir DIR",
		Short:         "virtio-fs daemon: share a host directory with a virtual machine",
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE:          func(cmd *cobra.Command, args []string) error { return run(o) },
	}
	cmd.SetVersionTemplate("") // -V is ours
	registerFlags(cmd.Flags(), o)
	return cmd
}

func run(o *Options) error {
	if o.Version {
		fmt.Printf("govirtiofsd %s\n", version)
		return nil
	}
	if o.PrintCapabilities {
		// The vhost-user back-end capabilities JSON (QEMU's
		// docs/interop/vhost-user.json). Features are listed only once
		// they are complete.
		fmt.Println("{\n  \"type\": \"fs\",\n  \"features\": [\n  ]\n}")
		return nil
	}
	log, err := newLogger(o.LogLevel)
	if err != nil {
		return err
	}
	if o.SharedDir == "" {
		return errors.New("--shared-dir (or -o source=) is required")
	}
	if (o.SocketPath == "") == (o.FD < 0) {
		return errors.New("give exactly one of --socket-path and --fd")
	}
	if o.Queues < 1 || o.Queues > vhostuser.MaxRings-1 {
		return fmt.Errorf("--queues %d: want 1..%d", o.Queues, vhostuser.MaxRings-1)
	}
	sbcfg, err := sandboxConfig(o, log)
	if err != nil {
		return err
	}
	// The process that created the socket removes it: the supervisor of a
	// sandboxed daemon, or the daemon itself with --sandbox none (inside a
	// sandbox the path would name a file of the share).
	ownSocket := o.SocketPath != "" && !sandbox.Resumed()
	if !sandbox.Resumed() {
		// Checked (and raised) here, where the host's paths and
		// CAP_SYS_RESOURCE are still at hand.
		if st, err := os.Stat(o.SharedDir); err != nil {
			return fmt.Errorf("shared directory: %w", err)
		} else if !st.IsDir() {
			return fmt.Errorf("shared directory %s is not a directory", o.SharedDir)
		}
		if err := setNofile(o, log); err != nil {
			return err
		}
	}
	in, err := enterSandbox(o, sbcfg)
	if err != nil {
		return err
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
		workers = runtime.NumCPU()
	}
	fsys, err := newFileSystem(o, in)
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

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	go func() {
		s := <-sigs
		log.Info("signal received, exiting", "signal", s.String())
		// Remove the socket we created, without closing the listener: a
		// failing Accept must not race this exit with an error.
		if ownSocket {
			os.Remove(o.SocketPath)
		}
		if p := metricsSocketPath(o.MetricsAddr); p != "" && !sandbox.Resumed() {
			os.Remove(p)
		}
		os.Exit(0)
	}()

	if err := in.Lock(); err != nil {
		return err
	}

	log.Info("waiting for vhost-user connection", "socket", o.SocketPath, "fd", o.FD, "shared_dir", o.SharedDir)
	c, err := ln.AcceptUnix()
	if err != nil {
		return fmt.Errorf("accept: %w", err)
	}
	// One front end per daemon, as with the C and Rust daemons: stop
	// listening (and remove the socket) once it is connected.
	ln.Close()
	if ownSocket {
		os.Remove(o.SocketPath)
	}
	log.Info("front end connected")
	defer c.Close()
	if err := backend.Serve(c); err != nil {
		return fmt.Errorf("vhost-user: %w", err)
	}
	return nil
}

// listen creates the vhost-user socket or adopts an inherited one.
func listen(o *Options) (*net.UnixListener, error) {
	if o.FD >= 0 {
		f := os.NewFile(uintptr(o.FD), "vhost-user-listener")
		l, err := net.FileListener(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("--fd %d: %w", o.FD, err)
		}
		ul, ok := l.(*net.UnixListener)
		if !ok {
			l.Close()
			return nil, fmt.Errorf("--fd %d is not a unix socket", o.FD)
		}
		ul.SetUnlinkOnClose(false) // not ours to remove
		return ul, nil
	}
	if st, err := os.Lstat(o.SocketPath); err == nil && st.Mode()&os.ModeSocket != 0 {
		os.Remove(o.SocketPath) // a stale socket from an earlier run
	}
	old := syscall.Umask(0o077) // the socket is created 0600
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: o.SocketPath, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", o.SocketPath, err)
	}
	ln.SetUnlinkOnClose(true)
	return ln, nil
}

func newLogger(level string) (*slog.Logger, error) {
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
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
}

// newFileSystem builds the passthrough file system on the sandbox's view of
// the shared directory and prepares the process for it: supplementary
// groups dropped (CVE-2022-0358).
func newFileSystem(o *Options, in *sandbox.Inside) (*passthrough.FS, error) {
	cache, err := passthrough.ParseCacheMode(o.Cache)
	if err != nil {
		return nil, err
	}
	handles, err := passthrough.ParseFileHandleMode(o.InodeFileHandles)
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
	}
	if o.Timeout != "" {
		secs, err := strconv.ParseFloat(o.Timeout, 64)
		if err != nil || secs < 0 {
			return nil, fmt.Errorf("-o timeout=%s: want seconds", o.Timeout)
		}
		popts.Timeout, popts.TimeoutSet = time.Duration(secs*float64(time.Second)), true
	}
	if err := passthrough.DropSupplementaryGroups(); err != nil {
		return nil, err
	}
	return passthrough.New(in.Root(), popts)
}

// setNofile applies --rlimit-nofile before the sandbox drops
// CAP_SYS_RESOURCE (the limit is inherited by its stages): not given, raise
// it to the default; N, set exactly N, as the Rust daemon does; 0, leave it.
func setNofile(o *Options, log *slog.Logger) error {
	switch {
	case o.RlimitNofile < 0:
		limit := defaultNofile()
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

// defaultNofile is min(1,000,000, fs.nr_open), as the Rust daemon uses.
func defaultNofile() uint64 {
	const want = 1_000_000
	b, err := os.ReadFile("/proc/sys/fs/nr_open")
	if err != nil {
		return want
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return want
	}
	return min(n, want)
}
