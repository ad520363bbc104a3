package passthrough

import (
	"fmt"
	"os"
	"time"
)

// What New is told: the options of the command line that concern the
// file system, and their parsers.

// CacheMode is the guest's caching policy.
type CacheMode int

const (
	// CacheAuto: entries and attributes valid for 1 s, page cache kept
	// until the attributes show a change.
	CacheAuto CacheMode = iota
	// CacheNever: nothing cached (timeouts 0, FOPEN_DIRECT_IO).
	CacheNever
	// CacheMetadata: entries and attributes cached for a day, file data
	// not cached (FOPEN_DIRECT_IO), as the Rust daemon does.
	CacheMetadata
	// CacheAlways: everything cached for a day (FOPEN_KEEP_CACHE,
	// FOPEN_CACHE_DIR).
	CacheAlways
)

// ParseCacheMode accepts the Rust daemon's names and the C daemon's
// ("none" is never, "normal" is auto).
func ParseCacheMode(s string) (CacheMode, error) {
	switch s {
	case "auto", "normal":
		return CacheAuto, nil
	case "never", "none":
		return CacheNever, nil
	case "metadata":
		return CacheMetadata, nil
	case "always":
		return CacheAlways, nil
	}
	return 0, fmt.Errorf("unknown cache mode %q (never|metadata|auto|always)", s)
}

func (c CacheMode) String() string {
	switch c {
	case CacheNever:
		return "never"
	case CacheMetadata:
		return "metadata"
	case CacheAlways:
		return "always"
	}
	return "auto"
}

// FileHandleMode is the Rust daemon's --inode-file-handles.
type FileHandleMode int

const (
	FileHandlesNever FileHandleMode = iota
	// FileHandlesPrefer holds inodes as file handles where the file
	// system supports them and as O_PATH fds elsewhere (or everywhere
	// when open_by_handle_at is not permitted).
	FileHandlesPrefer
	// FileHandlesMandatory refuses to start without file handles, and
	// fails lookups of objects that have none.
	FileHandlesMandatory
)

// ParseFileHandleMode parses never|prefer|mandatory.
func ParseFileHandleMode(s string) (FileHandleMode, error) {
	switch s {
	case "never", "":
		return FileHandlesNever, nil
	case "prefer":
		return FileHandlesPrefer, nil
	case "mandatory":
		return FileHandlesMandatory, nil
	}
	return 0, fmt.Errorf("unknown inode file handle mode %q (never|prefer|mandatory)", s)
}

// Options configures the file system. The zero value is cache=auto,
// readdirplus on, everything else off.
type Options struct {
	Cache CacheMode
	// Timeout overrides the cache mode's entry and attribute timeout
	// when TimeoutSet (the C daemon's -o timeout=).
	Timeout    time.Duration
	TimeoutSet bool

	Writeback     bool // FUSE_WRITEBACK_CACHE
	Xattr         bool // extended attributes; ENOSYS without
	PosixACL      bool // offer FUSE_POSIX_ACL (needs Xattr)
	SecurityLabel bool // offer FUSE_SECURITY_CTX: label what the guest creates with the context it sends
	// RequirePosixACL and RequireSecurityLabel refuse a session whose
	// guest does not offer the feature (--posix-acl=always,
	// --security-label=always); without them an offered feature the
	// guest lacks is left off (auto).
	RequirePosixACL      bool
	RequireSecurityLabel bool
	// XattrMap holds xattrmap rules in the C daemon's syntax
	// (":type:scope:key:prepend:" ...). Empty: names pass unchanged.
	XattrMap string

	AnnounceSubmounts bool // FUSE_SUBMOUNTS and FUSE_ATTR_SUBMOUNT
	NoReaddirplus     bool // do not offer READDIRPLUS
	AllowDirectIO     bool // keep the guest's O_DIRECT on host opens
	KillprivV2        bool // FUSE_HANDLE_KILLPRIV_V2

	InodeFileHandles FileHandleMode
	// InodeFDBudget bounds the O_PATH fds held by inodes that are held by
	// fd (no file handles): past it, unused inodes lose theirs and are
	// reopened by name when needed (budget.go). 0: half of RLIMIT_NOFILE
	// at New; at least 16.
	InodeFDBudget int

	PosixLocks bool // POSIX locks (OFD locks per lock owner)
	Flock      bool // flock(2) locks
	// MaxLocks bounds the lock owners (one fd each) the guest can hold
	// at once; 0 means 4096.
	MaxLocks int

	ReadOnly        bool // refuse every modification with EROFS
	PreserveNoatime bool // keep the guest's O_NOATIME (dropped by default)

	// ProcSelfFD is an fd of /proc/self/fd (O_PATH is enough) taken
	// before a sandbox hid /proc; New duplicates it. Nil: New opens
	// /proc/self/fd itself.
	ProcSelfFD *os.File

	// TranslateUID and TranslateGID translate ids between guest and
	// host (--translate-uid/--translate-gid); nil: ids pass unchanged.
	TranslateUID *IDMap
	TranslateGID *IDMap

	// Migration tunes live migration (SaveState, LoadState).
	Migration MigrationOptions

	// Window is the DAX window (--cache-size; dax.go): nil for none, and
	// SETUPMAPPING and REMOVEMAPPING are then ENOSYS. SetWindow sets it
	// after New.
	Window Window
	// InodeDAX says which regular files get FUSE_ATTR_DAX when the guest
	// mounts with dax=inode (--inode-dax): InodeDAXAll ("" too) or
	// InodeDAXFlag.
	InodeDAX string
}

// MigrationOnError is what a migration destination does with an inode it
// cannot reopen (the Rust daemon's --migration-on-error).
type MigrationOnError int

const (
	// MigrationAbort fails LoadState, so the migration fails and the VM
	// stays on the source.
	MigrationAbort MigrationOnError = iota
	// MigrationGuestError installs the inode, and its handles, as stale:
	// every request on them answers ESTALE; FORGET and RELEASE free them.
	MigrationGuestError
)

// ParseMigrationOnError parses abort|guest-error.
func ParseMigrationOnError(s string) (MigrationOnError, error) {
	switch s {
	case "abort", "":
		return MigrationAbort, nil
	case "guest-error":
		return MigrationGuestError, nil
	}
	return 0, fmt.Errorf("unknown migration error policy %q (abort|guest-error)", s)
}

func (m MigrationOnError) String() string {
	if m == MigrationGuestError {
		return "guest-error"
	}
	return "abort"
}

// MigrationMode is how the inodes travel (the Rust daemon's
// --migration-mode; source side: a destination reads either).
type MigrationMode int

const (
	// MigrationFindPaths sends a path below the shared directory for
	// every inode; the destination reopens it.
	MigrationFindPaths MigrationMode = iota
	// MigrationFileHandles sends every inode's file handle, and a path in
	// the share for each mount they are on; the destination opens them
	// with open_by_handle_at (CAP_DAC_READ_SEARCH). Source and destination
	// must share the very same file system; an open file unlinked on the
	// host migrates.
	MigrationFileHandles
)

// ParseMigrationMode parses find-paths|file-handles.
func ParseMigrationMode(s string) (MigrationMode, error) {
	switch s {
	case "find-paths", "":
		return MigrationFindPaths, nil
	case "file-handles":
		return MigrationFileHandles, nil
	}
	return 0, fmt.Errorf("unknown migration mode %q (find-paths|file-handles)", s)
}

func (m MigrationMode) String() string {
	if m == MigrationFileHandles {
		return "file-handles"
	}
	return "find-paths"
}

// MigrationOptions configure live migration (collect.go, save.go,
// load.go).
type MigrationOptions struct {
	// Mode: see MigrationMode (source side).
	Mode MigrationMode
	// OnError: see MigrationOnError (destination side).
	OnError MigrationOnError
	// ConfirmPaths re-checks at save every path collected when the
	// migration started and finds it again if it no longer leads to the
	// same object, so a host-side rename during the migration is
	// followed (the Rust daemon's --migration-confirm-paths; source side,
	// find-paths only).
	ConfirmPaths bool
	// VerifyHandles attaches each inode's file handle to its path, and a
	// destination that opened the path compares the handle of what it
	// opened: another object (a file replaced on the host) is unreachable
	// there, per OnError (the Rust daemon's --migration-verify-handles;
	// source side, find-paths only; the destination compares whenever a
	// state carries handles). Source and destination must share the same
	// file system.
	VerifyHandles bool
}

// The words of --posix-acl and --security-label (the Rust virtiofsd 1.14's
// negotiation modes).
const (
	NegotiateNever  = "never"  // not offered
	NegotiateAuto   = "auto"   // offered; off if the guest lacks it
	NegotiateAlways = "always" // offered; INIT fails if the guest lacks it
)
