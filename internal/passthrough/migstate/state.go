// Package migstate is the state of a passthrough file system that travels
// with a live migration, apart from the file system itself: the records a
// destination needs to serve the guest's FUSE session (every inode the
// guest holds and how to reopen it, every open handle, the options INIT
// turned on), the checks a loader makes of them before it opens anything
// (Validate), and the stream they travel in (Encode, Decode): the Rust
// virtiofsd's postcard message, which a Rust destination reads, followed by
// our trailer.
//
// internal/passthrough builds the records from its tables (SaveState) and
// reopens them (LoadState); this package touches no file system and keeps
// no state of its own. Every byte a decoder reads is the VMM's input: each
// count and length is checked against its bound before anything is
// allocated for it, and Validate checks ids, references and paths.
package migstate

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// The records are the Rust virtiofsd's serialized structs
// (src/passthrough/device_state/serialized.rs, 1.13), field for field, plus
// what our trailer adds (marked "ours"): a stream either daemon wrote
// decodes into them.
//
// Ids are restored exactly, whatever their value: the guest kernel caches
// node ids and file handles. NextInode and NextHandle are the Rust daemon's
// counters: a writer puts them above every id in use; a loader ignores them.

// RootID is the node id of the shared directory (FUSE_ROOT_ID).
const RootID = 1

// State is what a destination needs to serve the guest's FUSE session.
type State struct {
	// V2: the Rust PassthroughFs::V2 (with MountPaths); else V1.
	V2         bool
	Inodes     []Inode
	NextInode  uint64
	Handles    []Handle
	NextHandle uint64
	Opts       Negotiated
	MountPaths []MountPath // V2 only

	// Ours: the trailer was present (a stream of this daemon); Session
	// is the FUSE server's session record it carried (opaque here).
	Ours    bool
	Session []byte
}

// Negotiated is the Rust NegotiatedOpts: what INIT turned on that the file
// system must keep doing.
type Negotiated struct {
	Writeback         bool
	AnnounceSubmounts bool
	PosixACL          bool
	SuppGroups        bool // sup_group_extension: CREATE_SUPP_GROUP negotiated
}

// MountPath maps a mount id of the source (valid only there) to a path in
// the share on that mount, for file handles (V2's mount_paths).
type MountPath struct {
	MountID uint64
	Path    string // "." for the share's own mount
}

// Loc is the Rust InodeLocation variant (its index on the wire).
type Loc uint32

const (
	LocRoot       Loc = iota // the shared directory itself (node 1)
	LocPath                  // Parent's inode, then Path below it
	LocInvalid               // the source could not describe it
	LocFullPath              // Path below the shared directory
	LocFileHandle            // Handle on the mount MountPaths names
	numLocs
)

// FileHandle is the Rust SerializableFileHandle: what name_to_handle_at
// gave the source.
type FileHandle struct {
	MountID uint64 // the source's mount id
	Type    int32  // handle_type
	Bytes   []byte // f_handle, at most MAX_HANDLE_SZ (128) bytes
}

// Inode is one inode the guest holds (the Rust serialized::Inode).
type Inode struct {
	ID uint64
	// Refcount is the guest's lookup count plus one per record whose
	// location is LocPath with this inode as Parent (that reference is
	// dropped once the child is found). The root's also counts the
	// daemon's own two.
	Refcount uint64
	Loc      Loc
	Parent   uint64     // LocPath
	Path     string     // LocPath: below Parent; LocFullPath: below the share
	Handle   FileHandle // LocFileHandle
	// Verify, when set, is the object's file handle on the source: the
	// destination compares the handle of what it opened
	// (--migration-verify-handles).
	Verify *FileHandle

	// Ours: the S_IFMT type (0: unknown), and a path the message could
	// not carry (not UTF-8; the message says LocInvalid).
	Type    uint32
	RawPath string
}

// Handle is one open file or directory (the Rust serialized::Handle with
// HandleSource::OpenInode).
type Handle struct {
	ID    uint64
	Inode uint64 // RootID for the shared directory
	// Flags are the open(2) flags as the Rust daemon records them: the
	// guest's, without O_APPEND (writes append by their own flag),
	// O_CREAT, O_EXCL and O_TRUNC, with O_DIRECTORY for OPENDIR.
	Flags int32

	// Ours: Known when the trailer described the handle; then Dir
	// (OPENDIR) and HostFlags (our host open flags without O_CREAT,
	// O_EXCL, O_TRUNC and O_CLOEXEC).
	Known     bool
	Dir       bool
	HostFlags uint32
}

// IsDir tells a directory handle: from our trailer, else by the
// O_DIRECTORY the Rust daemon's OPENDIR adds.
func (h *Handle) IsDir() bool {
	if h.Known {
		return h.Dir
	}
	return h.Flags&unix.O_DIRECTORY != 0
}

// OpenFlags is the open flags to reopen a file handle with: our host flags
// from the trailer, else the Rust daemon's (the guest's) flags, which a
// loader turns into host flags as it does for OPEN.
func (h *Handle) OpenFlags() uint32 {
	if h.Known {
		return h.HostFlags
	}
	return uint32(h.Flags)
}

// Where describes a record's location, for logs and errors.
func (r *Inode) Where() string {
	switch {
	case r.RawPath != "":
		return fmt.Sprintf("path %q", r.RawPath)
	case r.Loc == LocFullPath:
		return fmt.Sprintf("path %q", r.Path)
	case r.Loc == LocPath:
		return fmt.Sprintf("%q below node %#x", r.Path, r.Parent)
	case r.Loc == LocFileHandle:
		return fmt.Sprintf("file handle of type %#x on mount %d", r.Handle.Type, r.Handle.MountID)
	}
	return "invalid on the source"
}

// Bounds checked before anything is allocated for a state.
const (
	// maxInodes bounds the inode records: beyond what the guest can
	// hold as O_PATH fds under the largest RLIMIT_NOFILE (fs.nr_open is
	// 1M by default), with room for file handle mode.
	maxInodes = 1 << 22
	// maxHandles bounds the handle records: each is an open fd.
	maxHandles = 1 << 20
	// maxMounts bounds the mount paths.
	maxMounts = 1 << 16
	// MaxPath bounds every path of a state: PATH_MAX without the NUL.
	MaxPath = 4095
	// maxHandleBytes is MAX_HANDLE_SZ.
	maxHandleBytes = 128
	// maxSessionRecord bounds the FUSE server's session record.
	maxSessionRecord = 4096
	// MaxSize bounds a whole stream: what a loader reads.
	MaxSize = 1 << 30
)

// CheckPath checks a path of a state: relative, at most MaxPath bytes,
// components of 1..NAME_MAX bytes without NUL, none "." or "..". A path
// that passes names an object below the share when each component is
// opened without following a symlink.
func CheckPath(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("empty path")
	case len(p) > MaxPath:
		return fmt.Errorf("path of %d bytes (max %d)", len(p), MaxPath)
	case p[0] == '/':
		return fmt.Errorf("absolute path")
	case strings.IndexByte(p, 0) >= 0:
		return fmt.Errorf("path with a NUL byte")
	}
	for c := range strings.SplitSeq(p, "/") {
		switch {
		case c == "":
			return fmt.Errorf("path with an empty component")
		case c == "." || c == "..":
			return fmt.Errorf("path with a %q component", c)
		case len(c) > unix.NAME_MAX:
			return fmt.Errorf("path component of %d bytes (max %d)", len(c), unix.NAME_MAX)
		}
	}
	return nil
}

// checkMountPath checks a mount path: "." (the share) or a state path.
func checkMountPath(p string) error {
	if p == "." {
		return nil
	}
	return CheckPath(p)
}

func validType(t uint32) bool {
	switch t {
	case unix.S_IFREG, unix.S_IFDIR, unix.S_IFLNK, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		return true
	}
	return false
}

func (h *FileHandle) check() error {
	if len(h.Bytes) == 0 || len(h.Bytes) > maxHandleBytes {
		return fmt.Errorf("file handle of %d bytes (1 to %d)", len(h.Bytes), maxHandleBytes)
	}
	return nil
}
