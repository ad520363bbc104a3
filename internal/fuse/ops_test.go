package fuse

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"reflect"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// opCase is one request, the calls the file system must see, and the
// exact reply.
type opCase struct {
	name    string
	op      uint32
	args    []byte   // fixed argument bytes
	names   []string // NUL-terminated names after the arguments
	raw     []byte   // bytes after the names
	ext     []byte   // the extension area (total_extlen*8 bytes) after raw
	outSize int      // writable room (0: 16 + len(payload))
	noReply bool
	errno   int32
	// calls builds the expected calls from the request header.
	calls   func(h gofuse.InHeader) []fsCall
	payload func(f *fakeFS) []byte
	setup   func(f *fakeFS)
	check   func(t *testing.T, f *fakeFS)
}

func dirent(ino, off uint64, typ uint32, name string) []byte {
	b := make([]byte, align8(24+len(name)))
	binary.LittleEndian.PutUint64(b[0:], ino)
	binary.LittleEndian.PutUint64(b[8:], off)
	binary.LittleEndian.PutUint32(b[16:], uint32(len(name)))
	binary.LittleEndian.PutUint32(b[20:], typ)
	copy(b[24:], name)
	return b
}

func direntplus(ino, off uint64, typ uint32, name string) []byte {
	e := gofuse.EntryOut{NodeId: ino + 1000, Attr: gofuse.Attr{Ino: ino, Mode: typ<<12 | 0644}}
	return append(outBytes(e, entryOutSize), dirent(ino, off, typ, name)...)
}

var testDirents = []fakeDirent{
	{".", 1, syscall.S_IFDIR},
	{"..", 1, syscall.S_IFDIR},
	{"file", 10, syscall.S_IFREG},
	{"a-longer-name-than-eight", 11, syscall.S_IFLNK},
}

func hdrOnly(op string) func(h gofuse.InHeader) []fsCall {
	return func(h gofuse.InHeader) []fsCall { return []fsCall{{Op: op, In: h}} }
}

func opCases() []opCase {
	entry := func(f *fakeFS) []byte { return outBytes(f.entry, entryOutSize) }
	attr := func(f *fakeFS) []byte { return outBytes(f.attr, attrOutSize) }
	open := func(f *fakeFS) []byte { return outBytes(f.open, openOutSize) }
	create := func(f *fakeFS) []byte {
		return outBytes(gofuse.CreateOut{EntryOut: f.entry, OpenOut: f.open}, createOutSize)
	}
	u32x2 := func(v uint32) func(*fakeFS) []byte {
		return func(*fakeFS) []byte { b := make([]byte, 8); binary.LittleEndian.PutUint32(b, v); return b }
	}
	setattr := gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{
		Valid: gofuse.FATTR_MODE | gofuse.FATTR_SIZE | gofuse.FATTR_FH | gofuse.FATTR_ATIME_NOW | gofuse.FATTR_KILL_SUIDGID,
		Fh:    3, Size: 1 << 40, LockOwner: 9, Atime: 11, Mtime: 12, Ctime: 13, Atimensec: 14, Mtimensec: 15,
		Ctimensec: 16, Mode: 0o4755, Owner: gofuse.Owner{Uid: 17, Gid: 18}}}
	mknod := gofuse.MknodIn{Mode: syscall.S_IFIFO | 0o644, Rdev: 0x801, Umask: 0o22}
	mkdir := gofuse.MkdirIn{Mode: 0o755, Umask: 0o22}
	link := gofuse.LinkIn{Oldnodeid: 33}
	openIn := gofuse.OpenIn{Flags: syscall.O_RDWR | syscall.O_TRUNC, Mode: gofuse.OPEN_KILL_SUIDGID}
	opendirIn := gofuse.OpenIn{Flags: syscall.O_RDONLY | syscall.O_DIRECTORY}
	createIn := gofuse.CreateIn{Flags: syscall.O_CREAT | syscall.O_WRONLY | syscall.O_EXCL, Mode: 0o644, Umask: 0o22, OpenFlags: 1}
	readIn := gofuse.ReadIn{Fh: 3, Offset: 10, Size: 5, ReadFlags: gofuse.READ_LOCKOWNER, LockOwner: 8, Flags: syscall.O_RDONLY}
	writeIn := gofuse.WriteIn{Fh: 3, Offset: 100, Size: 11, WriteFlags: gofuse.WRITE_KILL_SUIDGID, LockOwner: 8, Flags: syscall.O_WRONLY}
	flush := gofuse.FlushIn{Fh: 3, LockOwner: 0xdead}
	release := gofuse.ReleaseIn{Fh: 3, Flags: syscall.O_RDWR, ReleaseFlags: gofuse.RELEASE_FLUSH, LockOwner: 5}
	fsync := gofuse.FsyncIn{Fh: 3, FsyncFlags: 1}
	access := gofuse.AccessIn{Mask: gofuse.R_OK | gofuse.W_OK}
	setxattr := gofuse.SetXAttrIn{Size: 5, Flags: 1, SetXAttrFlags: gofuse.SETXATTR_ACL_KILL_SGID}
	falloc := gofuse.FallocateIn{Fh: 3, Offset: 4096, Length: 8192, Mode: 1}
	lseek := gofuse.LseekIn{Fh: 3, Offset: 100, Whence: 3}
	copyIn := gofuse.CopyFileRangeIn{FhIn: 1, OffIn: 2, NodeIdOut: 3, FhOut: 4, OffOut: 5, Len: 6, Flags: 0}
	statx := gofuse.StatxIn{GetattrFlags: gofuse.FUSE_GETATTR_FH, Fh: 3, SxFlags: 0x800, SxMask: 0x7ff}
	lk := gofuse.LkIn{Fh: 3, Owner: 0xabc, Lk: gofuse.FileLock{Start: 0, End: 99, Typ: syscall.F_RDLCK, Pid: 4}, LkFlags: gofuse.LK_FLOCK}
	getattr := gofuse.GetAttrIn{Flags_: gofuse.FUSE_GETATTR_FH, Fh_: 9}

	call := func(op string, in any, names ...string) func(gofuse.InHeader) []fsCall {
		return func(h gofuse.InHeader) []fsCall {
			var v any
			switch a := in.(type) {
			case nil:
				v = h
			case gofuse.GetAttrIn:
				v = withHdr(a, h)
			case gofuse.SetAttrIn:
				v = withHdr(a, h)
			case gofuse.MknodIn:
				v = withHdr(a, h)
			case gofuse.MkdirIn:
				v = withHdr(a, h)
			case gofuse.LinkIn:
				v = withHdr(a, h)
			case gofuse.OpenIn:
				v = withHdr(a, h)
			case gofuse.CreateIn:
				v = withHdr(a, h)
			case gofuse.ReadIn:
				v = withHdr(a, h)
			case gofuse.WriteIn:
				v = withHdr(a, h)
			case gofuse.FlushIn:
				v = withHdr(a, h)
			case gofuse.ReleaseIn:
				v = withHdr(a, h)
			case gofuse.FsyncIn:
				v = withHdr(a, h)
			case gofuse.AccessIn:
				v = withHdr(a, h)
			case gofuse.SetXAttrIn:
				v = withHdr(a, h)
			case gofuse.FallocateIn:
				v = withHdr(a, h)
			case gofuse.LseekIn:
				v = withHdr(a, h)
			case gofuse.CopyFileRangeIn:
				v = withHdr(a, h)
			case gofuse.StatxIn:
				v = withHdr(a, h)
			case gofuse.LkIn:
				v = withHdr(a, h)
			default:
				panic(fmt.Sprintf("type %T", in))
			}
			var ns []string
			if len(names) > 0 {
				ns = names
			}
			return []fsCall{{Op: op, In: v, Names: ns}}
		}
	}
	withArgs := func(f func(gofuse.InHeader) []fsCall, args ...uint64) func(gofuse.InHeader) []fsCall {
		return func(h gofuse.InHeader) []fsCall {
			c := f(h)
			c[0].Args = args
			return c
		}
	}

	return []opCase{
		{name: "LOOKUP", op: OpLookup, names: []string{"hello"}, calls: call("Lookup", nil, "hello"), payload: entry},
		{name: "LOOKUP error", op: OpLookup, names: []string{"nope"}, outSize: 16 + entryOutSize,
			setup: func(f *fakeFS) { f.errno = syscall.ENOENT }, errno: -int32(syscall.ENOENT), calls: call("Lookup", nil, "nope")},
		{name: "GETATTR", op: OpGetattr, args: argBytes(getattr, 16), calls: call("GetAttr", getattr), payload: attr},
		{name: "SETATTR", op: OpSetattr, args: argBytes(setattr, 88), calls: call("SetAttr", setattr), payload: attr},
		{name: "READLINK", op: OpReadlink, outSize: 16 + 4095, calls: withArgs(call("Readlink", nil), maxLink),
			payload: func(f *fakeFS) []byte { return f.link }},
		{name: "SYMLINK", op: OpSymlink, names: []string{"newname", "the/target"},
			calls: withArgs(call("Symlink", nil, "the/target", "newname"), noGroup), payload: entry},
		{name: "MKNOD", op: OpMknod, args: argBytes(mknod, 16), names: []string{"fifo"}, calls: withArgs(call("Mknod", mknod, "fifo"), noGroup), payload: entry},
		{name: "MKDIR", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, calls: withArgs(call("Mkdir", mkdir, "dir"), noGroup), payload: entry},
		// CREATE_SUPP_GROUP: the group reaches the file system, the
		// extension area is not part of the names.
		{name: "SYMLINK with a group", op: OpSymlink, names: []string{"newname", "the/target"}, ext: groupsExt(1, 4242),
			calls: withArgs(call("Symlink", nil, "the/target", "newname"), 4242), payload: entry},
		{name: "MKNOD with a group", op: OpMknod, args: argBytes(mknod, 16), names: []string{"fifo"}, ext: groupsExt(1, 7),
			calls: withArgs(call("Mknod", mknod, "fifo"), 7), payload: entry},
		{name: "MKDIR with a group", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(1, 0),
			calls: withArgs(call("Mkdir", mkdir, "dir"), 0), payload: entry},
		{name: "CREATE with a group", op: OpCreate, args: argBytes(createIn, 16), names: []string{"new"}, ext: groupsExt(1, 100),
			calls: withArgs(call("Create", createIn, "new"), 100), payload: create},
		{name: "TMPFILE with a group", op: OpTmpfile, args: argBytes(createIn, 16), ext: groupsExt(1, 100),
			calls: withArgs(call("Tmpfile", createIn), 100), payload: create},
		{name: "LOOKUP with a group", op: OpLookup, names: []string{"hello"}, ext: groupsExt(1, 5),
			calls: call("Lookup", nil, "hello"), payload: entry},
		{name: "MKDIR two groups", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(2, 7, 8),
			calls: withArgs(call("Mkdir", mkdir, "dir"), 7, 8), payload: entry},
		{name: "MKDIR most groups", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(MaxGroups, manyGroups(MaxGroups)...),
			calls: withArgs(call("Mkdir", mkdir, "dir"), u64s(manyGroups(MaxGroups))...), payload: entry},
		{name: "MKDIR too many groups", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(MaxGroups+1, manyGroups(MaxGroups+1)...),
			outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR fewer groups than nr_groups", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(4, 7, 8),
			outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR zero groups", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(0, 7),
			outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR second group -1", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(2, 7, NoGroup),
			outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR groups twice", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"},
			ext: append(groupsExt(1, 7), groupsExt(1, 8)...), outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR group -1", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"}, ext: groupsExt(1, NoGroup),
			outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR security context", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"},
			ext: extRec(1, []byte("12345678security.selinux\x00")), outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR extension size 0", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"},
			ext: make([]byte, 8), outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR extension size odd", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"},
			ext: setSize(groupsExt(1, 7), 12), outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "MKDIR extension beyond its area", op: OpMkdir, args: argBytes(mkdir, 8), names: []string{"dir"},
			ext: setSize(groupsExt(1, 7), 24), outSize: 16 + entryOutSize, errno: -int32(syscall.EINVAL)},
		{name: "FORGET bad extension", op: OpForget, args: argBytes(gofuse.ForgetIn{Nlookup: 3}, 8), ext: make([]byte, 8), noReply: true},
		{name: "UNLINK", op: OpUnlink, names: []string{"f"}, calls: call("Unlink", nil, "f")},
		{name: "RMDIR", op: OpRmdir, names: []string{"d"}, calls: call("Rmdir", nil, "d")},
		{name: "RENAME", op: OpRename, args: argBytes(gofuse.RenameIn{Newdir: 9}, 8), names: []string{"old", "new"},
			calls: withArgs(call("Rename", nil, "old", "new"), 9, 0)},
		{name: "RENAME2", op: OpRename2, args: argBytes(gofuse.RenameIn{Newdir: 9, Flags: 2}, 16), names: []string{"old", "new"},
			calls: withArgs(call("Rename", nil, "old", "new"), 9, 2)},
		{name: "LINK", op: OpLink, args: argBytes(link, 8), names: []string{"hard"}, calls: call("Link", link, "hard"), payload: entry},
		{name: "OPEN", op: OpOpen, args: argBytes(openIn, 8), calls: call("Open", openIn), payload: open},
		{name: "OPENDIR", op: OpOpendir, args: argBytes(opendirIn, 8), calls: call("OpenDir", opendirIn), payload: open},
		{name: "CREATE", op: OpCreate, args: argBytes(createIn, 16), names: []string{"new"},
			calls: withArgs(call("Create", createIn, "new"), noGroup), payload: create},
		{name: "TMPFILE", op: OpTmpfile, args: argBytes(createIn, 16), names: []string{"/"},
			calls: withArgs(call("Tmpfile", createIn), noGroup), payload: create},
		{name: "TMPFILE without name", op: OpTmpfile, args: argBytes(createIn, 16),
			calls: withArgs(call("Tmpfile", createIn), noGroup), payload: create},
		{name: "READ", op: OpRead, args: argBytes(readIn, 40), calls: call("Read", readIn),
			payload: func(f *fakeFS) []byte { return []byte("abcde") }},
		{name: "WRITE", op: OpWrite, args: argBytes(writeIn, 40), raw: []byte("hello world"), calls: call("Write", writeIn),
			payload: u32x2(11), check: func(t *testing.T, f *fakeFS) {
				if string(f.written) != "hello world" {
					t.Errorf("wrote %q", f.written)
				}
			}},
		{name: "FLUSH", op: OpFlush, args: argBytes(flush, 24), calls: call("Flush", flush)},
		{name: "RELEASE", op: OpRelease, args: argBytes(release, 24), calls: call("Release", release)},
		{name: "RELEASEDIR", op: OpReleasedir, args: argBytes(release, 24), calls: call("ReleaseDir", release)},
		{name: "FSYNC", op: OpFsync, args: argBytes(fsync, 16), calls: call("Fsync", fsync)},
		{name: "FSYNCDIR", op: OpFsyncdir, args: argBytes(fsync, 16), calls: call("FsyncDir", fsync)},
		{name: "READDIR", op: OpReaddir, args: argBytes(gofuse.ReadIn{Fh: 4, Size: 4096}, 40), outSize: 16 + 4096,
			setup: func(f *fakeFS) { f.dirents = testDirents },
			calls: withArgs(call("ReadDir", gofuse.ReadIn{Fh: 4, Size: 4096}), 0),
			payload: func(*fakeFS) []byte {
				return bytes.Join([][]byte{dirent(1, 1, 4, "."), dirent(1, 2, 4, ".."), dirent(10, 3, 8, "file"),
					dirent(11, 4, 10, "a-longer-name-than-eight")}, nil)
			}},
		{name: "READDIRPLUS", op: OpReaddirplus, args: argBytes(gofuse.ReadIn{Fh: 4, Offset: 2, Size: 4096}, 40), outSize: 16 + 4096,
			setup: func(f *fakeFS) { f.dirents = testDirents },
			calls: func(h gofuse.InHeader) []fsCall {
				return []fsCall{{Op: "ReadDir", In: withHdr(gofuse.ReadIn{Fh: 4, Offset: 2, Size: 4096}, h), Args: []uint64{1}},
					{Op: "ReadDirLookup", Args: []uint64{1010}}, {Op: "ReadDirLookup", Args: []uint64{1011}}}
			},
			payload: func(*fakeFS) []byte {
				return append(direntplus(10, 3, 8, "file"), direntplus(11, 4, 10, "a-longer-name-than-eight")...)
			}},
		{name: "STATFS", op: OpStatfs, calls: call("StatFs", nil), payload: func(f *fakeFS) []byte { return outBytes(f.statfs, statfsOutSize) }},
		{name: "ACCESS", op: OpAccess, args: argBytes(access, 8), calls: call("Access", access)},
		{name: "SETXATTR", op: OpSetxattr, args: argBytes(setxattr, 16), names: []string{"user.x"}, raw: []byte("value"),
			calls: call("SetXAttr", setxattr, "user.x", "value")},
		{name: "SETXATTR empty value", op: OpSetxattr, args: argBytes(gofuse.SetXAttrIn{}, 16), names: []string{"user.x"},
			calls: call("SetXAttr", gofuse.SetXAttrIn{}, "user.x", "")},
		{name: "GETXATTR size", op: OpGetxattr, args: argBytes(gofuse.GetXAttrIn{}, 8), names: []string{"user.x"},
			calls: withArgs(call("GetXAttr", nil, "user.x"), 0), payload: u32x2(5)},
		{name: "GETXATTR value", op: OpGetxattr, args: argBytes(gofuse.GetXAttrIn{Size: 100}, 8), names: []string{"user.x"},
			outSize: 16 + 100, calls: withArgs(call("GetXAttr", nil, "user.x"), 100),
			payload: func(f *fakeFS) []byte { return f.xattr }},
		{name: "GETXATTR ERANGE", op: OpGetxattr, args: argBytes(gofuse.GetXAttrIn{Size: 2}, 8), names: []string{"user.x"},
			outSize: 16 + 2, calls: withArgs(call("GetXAttr", nil, "user.x"), 2), errno: -int32(syscall.ERANGE)},
		{name: "LISTXATTR size", op: OpListxattr, args: argBytes(gofuse.GetXAttrIn{}, 8),
			calls: withArgs(call("ListXAttr", nil), 0), payload: u32x2(14)},
		{name: "LISTXATTR names", op: OpListxattr, args: argBytes(gofuse.GetXAttrIn{Size: 4096}, 8), outSize: 16 + 4096,
			calls: withArgs(call("ListXAttr", nil), 4096), payload: func(f *fakeFS) []byte { return f.xlist }},
		{name: "REMOVEXATTR", op: OpRemovexattr, names: []string{"user.x"}, calls: call("RemoveXAttr", nil, "user.x")},
		{name: "FALLOCATE", op: OpFallocate, args: argBytes(falloc, 32), calls: call("Fallocate", falloc)},
		{name: "LSEEK", op: OpLseek, args: argBytes(lseek, 24), calls: call("Lseek", lseek),
			payload: func(f *fakeFS) []byte { return outBytes(f.lseek, lseekOutSize) }},
		{name: "COPY_FILE_RANGE", op: OpCopyFileRange, args: argBytes(copyIn, 56), calls: withArgs(call("CopyFileRange", copyIn), MaxCopy32), payload: u32x2(4096)},
		{name: "COPY_FILE_RANGE 32-bit count", op: OpCopyFileRange, args: argBytes(copyIn, 56), setup: func(f *fakeFS) { f.copied = 5 << 30 },
			calls: withArgs(call("CopyFileRange", copyIn), MaxCopy32), payload: u32x2(MaxCopy32)},
		{name: "COPY_FILE_RANGE_64", op: OpCopyFileRange64, args: argBytes(copyIn, 56), setup: func(f *fakeFS) { f.copied = 5<<30 + 3 },
			calls: withArgs(call("CopyFileRange", copyIn), ^uint64(0)), payload: func(*fakeFS) []byte { return binary.LittleEndian.AppendUint64(nil, 5<<30+3) }},
		{name: "COPY_FILE_RANGE_64 error", op: OpCopyFileRange64, args: argBytes(copyIn, 56), outSize: 16 + 8,
			setup: func(f *fakeFS) { f.errno = syscall.EXDEV }, calls: withArgs(call("CopyFileRange", copyIn), ^uint64(0)), errno: -int32(syscall.EXDEV)},
		{name: "SYNCFS", op: OpSyncfs, args: make([]byte, 8), calls: call("SyncFs", nil)},
		{name: "STATX", op: OpStatx, args: argBytes(statx, 24), calls: call("Statx", statx),
			payload: func(f *fakeFS) []byte { return outBytes(f.statx, statxOutSize) }},
		{name: "GETLK", op: OpGetlk, args: argBytes(lk, 48), calls: call("GetLk", lk),
			payload: func(f *fakeFS) []byte { return outBytes(f.lk, lkOutSize) }},
		{name: "SETLK", op: OpSetlk, args: argBytes(lk, 48), calls: withArgs(call("SetLk", lk), 0)},
		{name: "SETLKW", op: OpSetlkw, args: argBytes(lk, 48), calls: withArgs(call("SetLk", lk), 1)},
		{name: "SETLK ENOSYS", op: OpSetlk, args: argBytes(lk, 48), calls: withArgs(call("SetLk", lk), 0),
			setup: func(f *fakeFS) { f.errno = syscall.ENOSYS }, errno: -int32(syscall.ENOSYS)},
		{name: "FORGET", op: OpForget, args: argBytes(gofuse.ForgetIn{Nlookup: 3}, 8), noReply: true,
			calls: func(gofuse.InHeader) []fsCall { return []fsCall{{Op: "Forget", Args: []uint64{testNode, 3}}} }},
		{name: "BATCH_FORGET", op: OpBatchForget, args: batchForget(2, 20, 1, 21, 1<<40), noReply: true,
			calls: func(gofuse.InHeader) []fsCall {
				return []fsCall{{Op: "Forget", Args: []uint64{20, 1}}, {Op: "Forget", Args: []uint64{21, 1 << 40}}}
			}},
		{name: "BATCH_FORGET count beyond request", op: OpBatchForget, args: batchForget(1000, 20, 1), noReply: true,
			calls: func(gofuse.InHeader) []fsCall { return []fsCall{{Op: "Forget", Args: []uint64{20, 1}}} }},
		{name: "INTERRUPT", op: OpInterrupt, args: make([]byte, 8), noReply: true},
		{name: "NOTIFY_REPLY", op: OpNotifyReply, args: make([]byte, 40), noReply: true},
		{name: "IOCTL", op: OpIoctl, args: make([]byte, 32), outSize: 16 + 16, errno: -int32(syscall.ENOSYS)},
		{name: "BMAP", op: OpBmap, args: make([]byte, 16), outSize: 16 + 8, errno: -int32(syscall.ENOSYS)},
		{name: "POLL", op: OpPoll, args: make([]byte, 24), outSize: 16 + 8, errno: -int32(syscall.ENOSYS)},
		{name: "SETUPMAPPING", op: OpSetupMapping, args: make([]byte, 40), errno: -int32(syscall.ENOSYS)},
		{name: "REMOVEMAPPING", op: OpRemoveMapping, args: make([]byte, 8), errno: -int32(syscall.ENOSYS)},
		{name: "unknown opcode", op: 4242, errno: -int32(syscall.ENOSYS)},
		{name: "DESTROY", op: OpDestroy, calls: func(gofuse.InHeader) []fsCall { return []fsCall{{Op: "Destroy"}} }},
	}
}

const noGroup = uint64(NoGroup)

// manyGroups returns the groups 1000..1000+n-1.
func manyGroups(n int) []uint32 {
	g := make([]uint32, n)
	for i := range g {
		g[i] = 1000 + uint32(i)
	}
	return g
}

func u64s(v []uint32) []uint64 {
	a := make([]uint64, len(v))
	for i, x := range v {
		a[i] = uint64(x)
	}
	return a
}

// extRec is one request extension: fuse_ext_header then body, padded to 8.
func extRec(typ uint32, body []byte) []byte {
	n := align8(extHeaderSize + len(body))
	b := make([]byte, n)
	binary.LittleEndian.PutUint32(b, uint32(n))
	binary.LittleEndian.PutUint32(b[4:], typ)
	copy(b[8:], body)
	return b
}

// groupsExt is FUSE_EXT_GROUPS with nr_groups and the groups given.
func groupsExt(nr uint32, groups ...uint32) []byte {
	b := binary.LittleEndian.AppendUint32(nil, nr)
	for _, g := range groups {
		b = binary.LittleEndian.AppendUint32(b, g)
	}
	return extRec(extGroups, b)
}

// setSize overwrites an extension's size field.
func setSize(ext []byte, size uint32) []byte {
	binary.LittleEndian.PutUint32(ext, size)
	return ext
}

// withExt appends an extension area to req and sets total_extlen (in
// 8-byte units, rounded up) and the length.
func withExt(req, ext []byte) []byte {
	req = append(append([]byte(nil), req...), ext...)
	binary.LittleEndian.PutUint32(req, uint32(len(req)))
	binary.LittleEndian.PutUint16(req[36:], uint16((len(ext)+7)/8))
	return req
}

func batchForget(count uint32, pairs ...uint64) []byte {
	b := make([]byte, 8, 8+8*len(pairs))
	binary.LittleEndian.PutUint32(b, count)
	for _, v := range pairs {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	return b
}

// splitModes are the ways each request and reply are cut into segments:
// whole, one byte per segment (every name and struct straddles segments),
// and odd sizes.
var splitModes = []struct {
	name      string
	inK, outK int
}{{"whole", 0, 0}, {"bytewise", 1, 1}, {"7-byte", 7, 7}, {"header-apart", 40, 16}}

func TestOpcodes(t *testing.T) {
	for i, tc := range opCases() {
		for _, sm := range splitModes {
			t.Run(tc.name+"/"+sm.name, func(t *testing.T) {
				f := newFakeFS()
				_, q := newSession(t, f)
				if tc.setup != nil {
					tc.setup(f)
				}
				unique := uint64(0x1000 + i)
				req := mkreq(tc.op, unique, tc.args, tc.names, tc.raw)
				if tc.ext != nil {
					req = withExt(req, tc.ext)
				}
				var payload []byte
				if tc.payload != nil && tc.errno == 0 {
					payload = tc.payload(f)
				}
				outSize := tc.outSize
				if outSize == 0 {
					outSize = OutHeaderSize + len(payload)
				}
				if tc.noReply {
					outSize = 0
				}
				got := serve(t, q, req, sm.inK, outSize, sm.outK)
				switch {
				case tc.noReply:
					if len(got) != 0 {
						t.Fatalf("reply % x to a request that gets none", got)
					}
				default:
					if want := replyBytes(unique, tc.errno, payload); !bytes.Equal(got, want) {
						t.Fatalf("reply\n got % x\nwant % x", got, want)
					}
				}
				var want []fsCall
				if tc.calls != nil {
					want = tc.calls(hdrOf(req))
				}
				if calls := f.lastCalls(); !reflect.DeepEqual(calls, want) {
					t.Fatalf("calls\n got %+v\nwant %+v", calls, want)
				}
				if tc.check != nil {
					tc.check(t, f)
				}
			})
		}
	}
}

// Without FUSE_SETXATTR_EXT, fuse_setxattr_in is 8 bytes.
func TestSetxattrCompat(t *testing.T) {
	f := newFakeFS()
	f.caps = 0
	_, q := newSession(t, f)
	in := gofuse.SetXAttrIn{Size: 3, Flags: 2}
	req := mkreq(OpSetxattr, 9, argBytes(in, 8), []string{"trusted.y"}, []byte("a\x00b"))
	if got, want := serve(t, q, req, 1, 16, 1), replyBytes(9, 0, nil); !bytes.Equal(got, want) {
		t.Fatalf("reply % x, want % x", got, want)
	}
	want := []fsCall{{Op: "SetXAttr", In: withHdr(in, hdrOf(req)), Names: []string{"trusted.y", "a\x00b"}}}
	if calls := f.lastCalls(); !reflect.DeepEqual(calls, want) {
		t.Fatalf("calls\n got %+v\nwant %+v", calls, want)
	}
}

// fixedReply reports whether the case's success reply has a fixed size.
func fixedReply(tc opCase) bool {
	switch tc.op {
	case OpLookup, OpGetattr, OpSetattr, OpSymlink, OpMknod, OpMkdir, OpLink, OpOpen, OpOpendir, OpCreate,
		OpTmpfile, OpWrite, OpStatfs, OpLseek, OpCopyFileRange, OpCopyFileRange64, OpStatx, OpGetlk:
		return true
	case OpGetxattr, OpListxattr:
		return strings.HasSuffix(tc.name, " size")
	}
	return false
}

// Every decoder fails cleanly on truncated arguments, on a file system
// error, and (for fixed-size replies) on a reply that would not fit: in the
// first and last case without calling the file system.
func TestOpcodeErrors(t *testing.T) {
	for i, tc := range opCases() {
		if tc.noReply || tc.errno != 0 || tc.op == OpDestroy {
			continue
		}
		unique := uint64(0x2000 + i)
		t.Run(tc.name+"/fs error", func(t *testing.T) {
			f := newFakeFS()
			_, q := newSession(t, f)
			if tc.setup != nil {
				tc.setup(f)
			}
			f.errno, f.dirents = syscall.EIO, nil
			want := replyBytes(unique, -int32(syscall.EIO), nil)
			if tc.op == OpRelease || tc.op == OpReleasedir || tc.op == OpReaddir || tc.op == OpReaddirplus {
				want = replyBytes(unique, 0, nil) // no error to report, or no entries
				if tc.op == OpReaddir || tc.op == OpReaddirplus {
					want = replyBytes(unique, -int32(syscall.EIO), nil)
				}
			}
			got := serve(t, q, mkreq(tc.op, unique, tc.args, tc.names, tc.raw), 3, 16+4096, 5)
			if !bytes.Equal(got, want) {
				t.Fatalf("reply\n got % x\nwant % x", got, want)
			}
		})
		if len(tc.args) > 0 {
			t.Run(tc.name+"/truncated", func(t *testing.T) {
				f := newFakeFS()
				_, q := newSession(t, f)
				got := serve(t, q, mkreq(tc.op, unique, tc.args[:len(tc.args)-1], nil, nil), 1, 16+4096, 0)
				if want := replyBytes(unique, -int32(syscall.EINVAL), nil); !bytes.Equal(got, want) {
					t.Fatalf("reply\n got % x\nwant % x", got, want)
				}
				if calls := f.lastCalls(); len(calls) != 0 {
					t.Fatalf("calls %+v", calls)
				}
			})
		}
		if fixedReply(tc) {
			t.Run(tc.name+"/no room", func(t *testing.T) {
				f := newFakeFS()
				_, q := newSession(t, f)
				if tc.setup != nil {
					tc.setup(f)
				}
				got := serve(t, q, mkreq(tc.op, unique, tc.args, tc.names, tc.raw), 0, 16+len(tc.payload(f))-1, 0)
				if want := replyBytes(unique, -int32(syscall.EINVAL), nil); !bytes.Equal(got, want) {
					t.Fatalf("reply\n got % x\nwant % x", got, want)
				}
				if calls := f.lastCalls(); len(calls) != 0 {
					t.Fatalf("calls %+v", calls)
				}
			})
		}
	}
}

// An extension area that claims more than the request after its header is
// refused; the queue serves the next request as usual.
func TestExtensionAreaBounds(t *testing.T) {
	f := newFakeFS()
	_, q := newSession(t, f)
	mkdir := argBytes(gofuse.MkdirIn{Mode: 0o755}, 8)
	for _, extlen := range []uint16{1, 3, 0xffff} {
		req := mkreq(OpMkdir, 5, mkdir, []string{"d"}, nil)
		binary.LittleEndian.PutUint16(req[36:], extlen)
		if r := serve(t, q, req, 0, 16+entryOutSize, 0); errnoOf(r) != -int32(syscall.EINVAL) {
			t.Fatalf("total_extlen %d: reply % x", extlen, r)
		}
	}
	if calls := f.lastCalls(); len(calls) != 0 {
		t.Fatalf("file system called: %+v", calls)
	}
	if r := serve(t, q, mkreq(OpStatfs, 6, nil, nil, nil), 0, 16+statfsOutSize, 0); errnoOf(r) != 0 {
		t.Fatalf("STATFS after: % x", r)
	}
}
