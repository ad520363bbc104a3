package fuse

import (
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// FileSystem is what the FUSE server calls to serve requests. The server
// decodes and validates each request (lengths, NUL-terminated names) and
// passes the decoded argument structs, whose embedded InHeader carries the
// node id and the caller's uid, gid and pid. Every method returns 0 or an
// errno for the reply; it must never panic on guest input.
//
// The signatures use only go-fuse's wire structs, byte slices, bufvec and
// unnamed func types, so a file system (internal/passthrough) satisfies the
// interface without importing this package.
//
// Names are the guest's bytes without the terminating NUL, already checked
// to contain no NUL. They are copies in per-queue scratch memory (never the
// guest's memory, which the guest could change between a check and its use)
// and must not be retained after the call returns.
//
// The methods that create an object (Symlink, Mknod, Mkdir, Create,
// Tmpfile) also get groups: the caller's supplementary groups that the
// guest sent with the request (FUSE_EXT_GROUPS, with CAP_CREATE_SUPP_GROUP
// negotiated) because the caller may create in the parent directory only
// through one of them; nil when none came. At most MaxGroups, none of
// them NoGroup; the slice is the server's scratch and must not be retained
// after the call. And sec: the security context to label the new object
// with (SecCtx, with CAP_SECURITY_CTX negotiated), nil when none came.
//
// Methods are called concurrently from several queues.
type FileSystem interface {
	// Capabilities returns the gofuse.CAP_* bits (flags|flags2<<32) the
	// file system wants given its options: writeback cache, POSIX ACLs,
	// security labels, submounts, killpriv_v2, ... The server offers their
	// intersection with what the guest supports.
	Capabilities() uint64
	// Init starts a session with the capabilities the server negotiated
	// (gofuse.CAP_* bits in the 64-bit flags|flags2<<32 form). A second
	// Init, or Init after Destroy, drops every inode and handle of the
	// previous session first.
	Init(caps uint64)
	// Destroy ends the session: every inode and handle is released.
	Destroy()

	Lookup(h *gofuse.InHeader, name []byte, out *gofuse.EntryOut) syscall.Errno
	// Forget drops nlookup references to node id (FORGET, BATCH_FORGET).
	// Unknown ids and counts beyond what is held are ignored.
	Forget(nodeID, nlookup uint64)
	GetAttr(in *gofuse.GetAttrIn, out *gofuse.AttrOut) syscall.Errno
	SetAttr(in *gofuse.SetAttrIn, out *gofuse.AttrOut) syscall.Errno
	// Readlink writes the target into buf (PATH_MAX bytes) and returns
	// its length.
	Readlink(h *gofuse.InHeader, buf []byte) (int, syscall.Errno)
	Symlink(h *gofuse.InHeader, groups []uint32, sec *SecCtx, target, name []byte, out *gofuse.EntryOut) syscall.Errno
	Mknod(in *gofuse.MknodIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.EntryOut) syscall.Errno
	Mkdir(in *gofuse.MkdirIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.EntryOut) syscall.Errno
	Unlink(h *gofuse.InHeader, name []byte) syscall.Errno
	Rmdir(h *gofuse.InHeader, name []byte) syscall.Errno
	// Rename moves h.NodeId/oldName to newDir/newName; flags are
	// RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT (0 for RENAME).
	Rename(h *gofuse.InHeader, newDir uint64, flags uint32, oldName, newName []byte) syscall.Errno
	Link(in *gofuse.LinkIn, name []byte, out *gofuse.EntryOut) syscall.Errno

	Open(in *gofuse.OpenIn, out *gofuse.OpenOut) syscall.Errno
	Create(in *gofuse.CreateIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.CreateOut) syscall.Errno
	// Tmpfile creates an unnamed file in directory in.NodeId.
	Tmpfile(in *gofuse.CreateIn, groups []uint32, sec *SecCtx, out *gofuse.CreateOut) syscall.Errno
	// Read reads up to in.Size bytes at in.Offset straight into dst (one
	// preadv of guest memory) and returns the byte count. The server
	// clamps in.Size to dst.Len(), the room after the reply header.
	Read(in *gofuse.ReadIn, dst *bufvec.Vec) (int, syscall.Errno)
	// Write writes the in.Size bytes of src at in.Offset (one pwritev from
	// guest memory) and returns the byte count. src holds exactly in.Size
	// bytes after its cursor, at most max_write.
	Write(in *gofuse.WriteIn, src *bufvec.Vec) (int, syscall.Errno)
	Flush(in *gofuse.FlushIn) syscall.Errno
	Release(in *gofuse.ReleaseIn)
	Fsync(in *gofuse.FsyncIn) syscall.Errno
	Fallocate(in *gofuse.FallocateIn) syscall.Errno
	Lseek(in *gofuse.LseekIn, out *gofuse.LseekOut) syscall.Errno
	// CopyFileRange copies at most min(in.Len, limit) bytes (COPY_FILE_RANGE
	// and COPY_FILE_RANGE_64) and returns how many it copied.
	CopyFileRange(in *gofuse.CopyFileRangeIn, limit uint64) (uint64, syscall.Errno)

	OpenDir(in *gofuse.OpenIn, out *gofuse.OpenOut) syscall.Errno
	// ReadDir lists directory in.NodeId from offset in.Offset. For each
	// entry it calls emit with the entry's name (copied by emit), inode
	// number, type (the S_IFMT bits of its mode; a DT_* value is accepted
	// too) and the offset of the next entry. emit returns false when the
	// reply is full: the entry was not added and ReadDir must stop. For
	// READDIRPLUS (plus), emit returns a non-nil EntryOut that the file
	// system fills in as for LOOKUP (taking a lookup reference) before the
	// next call to emit or its return; an entry it cannot look up gets
	// NodeId 0 and no reference. Entries emitted before an error are still
	// delivered; a reference whose entry could not be written into the
	// reply is dropped with Forget(NodeId, 1) after ReadDir returns.
	ReadDir(in *gofuse.ReadIn, plus bool, emit func(name []byte, ino uint64, typ uint32, off uint64) (*gofuse.EntryOut, bool)) syscall.Errno
	ReleaseDir(in *gofuse.ReleaseIn)
	FsyncDir(in *gofuse.FsyncIn) syscall.Errno

	StatFs(h *gofuse.InHeader, out *gofuse.StatfsOut) syscall.Errno
	Access(in *gofuse.AccessIn) syscall.Errno
	SyncFs(h *gofuse.InHeader) syscall.Errno
	Statx(in *gofuse.StatxIn, out *gofuse.StatxOut) syscall.Errno

	SetXAttr(in *gofuse.SetXAttrIn, name, value []byte) syscall.Errno
	// GetXAttr writes the value into dst; with len(dst) == 0 it returns the
	// size needed. ERANGE when dst is too small.
	GetXAttr(h *gofuse.InHeader, name []byte, dst []byte) (int, syscall.Errno)
	// ListXAttr writes the NUL-separated names into dst; with len(dst) ==
	// 0 it returns the size needed.
	ListXAttr(h *gofuse.InHeader, dst []byte) (int, syscall.Errno)
	RemoveXAttr(h *gofuse.InHeader, name []byte) syscall.Errno

	// GetLk and SetLk implement POSIX (and flock) locks when enabled;
	// otherwise they return ENOSYS. SetLk with wait must not block
	// indefinitely.
	GetLk(in *gofuse.LkIn, out *gofuse.LkOut) syscall.Errno
	SetLk(in *gofuse.LkIn, wait bool) syscall.Errno

	// SetupMapping maps length bytes of node h.NodeId's file at foffset
	// into the DAX window at moffset (SETUPMAPPING; flags
	// SetupMappingRead|SetupMappingWrite); fh is the guest's handle, or
	// ^0 (Linux sends -1). RemoveMapping removes the mappings lying in
	// each of ranges (a REMOVEMAPPING's entries), all of them or, when one
	// cannot be (it cuts through a mapping), none; it must not keep
	// ranges, the server's scratch. The
	// server calls them only in a session with a window (Windowed), with
	// values already checked against it (dax.go); without one they may
	// answer ENOSYS.
	SetupMapping(h *gofuse.InHeader, fh, foffset, length, flags, moffset uint64) syscall.Errno
	RemoveMapping(ranges []MapRange) syscall.Errno
}

// NoGroup is (gid_t)-1, never a valid group: a FUSE_EXT_GROUPS naming it
// is refused.
const NoGroup = ^uint32(0)
