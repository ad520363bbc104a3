package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
	"github.com/govirtiofsd/govirtiofsd/internal/sandbox"
)

// Inode file handles (--inode-file-handles, prefer by default) need
// CAP_DAC_READ_SEARCH in the host's user namespace for open_by_handle_at.
// The sandbox keeps that capability only when handles can be used on the
// share's own file system; a capability dropped cannot come back. The first
// process decides, where the share is at its host path and the process
// holds whatever it was started with (handleDecision), and hands the
// decision to the sandbox's later stages in envFileHandles: they run
// inside the namespace or chroot, where the share is "/", and with
// capabilities already dropped, so a probe of their own could answer
// otherwise, and every stage must build the same sandbox.Config.

// envFileHandles carries the first process's handleDecision to the later
// stages of a sandboxed daemon, and envFileHandlesWhy the reason handles
// are not used, which the serving process logs. The first process always
// sets them.
const (
	envFileHandles    = "GOVIRTIOFSD_FILE_HANDLES"
	envFileHandlesWhy = "GOVIRTIOFSD_FILE_HANDLES_WHY"
)

// handleDecision is what the first process decided about inode file
// handles.
type handleDecision string

const (
	// handlesUndecided: a process that builds no file system (the
	// --daemonize parent, the supervisor's reaped stage).
	handlesUndecided handleDecision = ""
	// handlesOff: --inode-file-handles=never.
	handlesOff handleDecision = "off"
	// handlesUsable: the share's file system gives handles and this
	// process may open them: CAP_DAC_READ_SEARCH is kept.
	handlesUsable handleDecision = "usable"
	// handlesNoFS: the share's file system gives none: the capability
	// is dropped and the file system holds the share's inodes as fds; a
	// submount that gives handles is held by fds too (the passthrough
	// finds open_by_handle_at refused there, and says so once).
	handlesNoFS handleDecision = "no-fs"
	// handlesNotPermitted: the serving process will not hold the
	// capability in the host's user namespace (non-root, a user namespace
	// of its own, --modcaps): every inode is held as an fd.
	handlesNotPermitted handleDecision = "not-permitted"
)

// decideFileHandles makes the decision in the first process (probing the
// shared directory, refusing mandatory without handles) and exports it to
// the later stages; a later stage takes it from there.
func (d *daemon) decideFileHandles() error {
	o := d.o
	if !d.proc.first {
		v := handleDecision(os.Getenv(envFileHandles))
		switch {
		case d.proc.reaped:
		case v == handlesOff || v == handlesUsable || v == handlesNoFS || v == handlesNotPermitted:
		default:
			return fmt.Errorf("%s=%q: this stage was not started by the daemon's first process", envFileHandles, v)
		}
		o.handles, o.handlesWhy = v, os.Getenv(envFileHandlesWhy)
		return nil
	}
	v, why := probeFileHandles(o)
	if v != handlesUsable && v != handlesOff && o.InodeFileHandles == "mandatory" {
		return fmt.Errorf("--inode-file-handles=mandatory: %s", why)
	}
	o.handles, o.handlesWhy = v, why
	if err := os.Setenv(envFileHandles, string(v)); err != nil {
		return err
	}
	return os.Setenv(envFileHandlesWhy, why)
}

// logFileHandles is the one line of the process that serves when prefer
// falls back to fds for want of the capability. (When the share's file
// system gives no handles, the passthrough says so, per mount.)
func logFileHandles(o *Options, log *slog.Logger) {
	if o.handles == handlesNotPermitted {
		log.Info("inode file handles unusable here: every inode is held as an O_PATH fd (--inode-file-handles=never says so without this line)",
			"why", o.handlesWhy)
	}
}

// probeFileHandles decides, from the options and the shared directory's
// file system, whether the daemon holds inodes as file handles, and why
// not.
func probeFileHandles(o *Options) (handleDecision, string) {
	if o.InodeFileHandles == "never" {
		return handlesOff, ""
	}
	sandboxed := o.Sandbox != sandbox.None.String()
	if sandboxed && (len(o.UIDMaps) > 0 || len(o.GIDMaps) > 0) {
		return handlesNotPermitted, "the daemon runs in a user namespace of its own (--uid-map/--gid-map), which holds no capability in the host's: open_by_handle_at needs CAP_DAC_READ_SEARCH there"
	}
	if caps, err := sandbox.ParseModcaps(sandbox.FileHandleCaps, o.Modcaps); sandboxed && err == nil && caps&sandbox.FileHandleCaps == 0 {
		return handlesNotPermitted, "--modcaps drops CAP_DAC_READ_SEARCH, which open_by_handle_at needs"
	}
	err := passthrough.ProbeFileHandles(o.SharedDir)
	switch {
	case err == nil:
		return handlesUsable, ""
	case errors.Is(err, passthrough.ErrHandlesNotPermitted):
		return handlesNotPermitted, err.Error()
	}
	return handlesNoFS, "the shared directory's file system gives no file handles: " + err.Error()
}

// fileHandleMode is the passthrough's --inode-file-handles after the
// decision: never where the daemon may not open handles.
func fileHandleMode(o *Options) (passthrough.FileHandleMode, error) {
	if o.handles == handlesOff || o.handles == handlesNotPermitted {
		return passthrough.FileHandlesNever, nil
	}
	return passthrough.ParseFileHandleMode(o.InodeFileHandles)
}

// keepsHandleCaps says whether the sandbox keeps CAP_DAC_READ_SEARCH:
// inodes held as handles, or a file-handles migration (the Rust daemon's
// users give --modcaps=+dac_read_search instead, which works too).
func keepsHandleCaps(o *Options) bool {
	return o.handles == handlesUsable || o.MigrationMode == "file-handles"
}
