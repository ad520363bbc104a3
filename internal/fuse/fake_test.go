package fuse

import (
	"sync"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// fsCall records one call the server made into fakeFS.
type fsCall struct {
	Op    string
	In    any      // the decoded argument struct (a copy) or InHeader
	Names []string // names and values, in the order of the method's parameters
	Args  []uint64 // other scalar arguments
}

// fakeFS records every call and answers with canned values.
type fakeFS struct {
	mu    sync.Mutex
	calls []fsCall

	caps     uint64
	errno    syscall.Errno // returned by every method that returns one
	entry    gofuse.EntryOut
	attr     gofuse.AttrOut
	open     gofuse.OpenOut
	statfs   gofuse.StatfsOut
	statx    gofuse.StatxOut
	lk       gofuse.LkOut
	lseek    gofuse.LseekOut
	link     []byte
	data     []byte // READ returns data[in.Offset:]
	written  []byte // what WRITE received
	xattr    []byte
	xlist    []byte
	copied   uint64
	dirents  []fakeDirent
	readN    int // when > 0, READ claims this many bytes (to test bad counts)
	dirErrAt int // when > 0, ReadDir returns errno after this many entries
	// window is the DAX window's size WindowSize reports (0: none).
	window uint64
	// negotiate, when set, is the Negotiator's answer at INIT.
	negotiate func(offered, caps uint64) (uint64, error)
}

type fakeDirent struct {
	name string
	ino  uint64
	typ  uint32
}

func newFakeFS() *fakeFS {
	return &fakeFS{
		caps: gofuse.CAP_SETXATTR_EXT | gofuse.CAP_READDIRPLUS | gofuse.CAP_WRITEBACK_CACHE,
		entry: gofuse.EntryOut{NodeId: 42, Generation: 7, EntryValid: 1, AttrValid: 2, EntryValidNsec: 3, AttrValidNsec: 4,
			Attr: gofuse.Attr{Ino: 42, Size: 1234, Blocks: 8, Atime: 5, Mtime: 6, Ctime: 7, Mode: syscall.S_IFREG | 0644,
				Nlink: 1, Owner: gofuse.Owner{Uid: 1000, Gid: 100}, Blksize: 4096}},
		attr: gofuse.AttrOut{AttrValid: 1, AttrValidNsec: 9,
			Attr: gofuse.Attr{Ino: 1, Size: 4096, Mode: syscall.S_IFDIR | 0755, Nlink: 2}},
		open:   gofuse.OpenOut{Fh: 0x1122334455667788, OpenFlags: gofuse.FOPEN_KEEP_CACHE},
		statfs: gofuse.StatfsOut{Blocks: 100, Bfree: 50, Bavail: 40, Files: 10, Ffree: 5, Bsize: 4096, NameLen: 255, Frsize: 4096},
		statx:  gofuse.StatxOut{AttrValid: 1, Statx: gofuse.Statx{Mask: 0x7ff, Blksize: 4096, Nlink: 1, Mode: 0100600, Ino: 77, Size: 99}},
		lk:     gofuse.LkOut{Lk: gofuse.FileLock{Start: 1, End: 2, Typ: syscall.F_WRLCK, Pid: 33}},
		lseek:  gofuse.LseekOut{Offset: 8192},
		link:   []byte("target/of/link"),
		data:   []byte("0123456789abcdefghijklmnopqrstuvwxyz"),
		xattr:  []byte("value"),
		xlist:  []byte("user.a\x00user.b\x00"),
		copied: 4096,
	}
}

// record records a call and returns the errno every call returns.
func (f *fakeFS) record(op string, in any, names []string, args ...uint64) syscall.Errno {
	f.mu.Lock()
	f.calls = append(f.calls, fsCall{Op: op, In: in, Names: names, Args: args})
	f.mu.Unlock()
	return f.errno
}

func (f *fakeFS) lastCalls() []fsCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fsCall(nil), f.calls...)
}

func strs(b ...[]byte) []string {
	s := make([]string, len(b))
	for i := range b {
		s[i] = string(b[i])
	}
	return s
}

// withSec adds a creation's security context to the recorded names as
// "NAME=VALUE" (copied: it lives in the queue's scratch memory).
func withSec(names []string, sec *SecCtx) []string {
	if sec == nil {
		return names
	}
	return append(names, string(sec.Name)+"="+string(sec.Value))
}

func (f *fakeFS) Capabilities() uint64 { return f.caps }

// Negotiate is fuse.Negotiator: f.negotiate, if set, has the last word.
func (f *fakeFS) Negotiate(offered, caps uint64) (uint64, error) {
	if f.negotiate == nil {
		return caps, nil
	}
	return f.negotiate(offered, caps)
}
func (f *fakeFS) Init(caps uint64) { f.record("Init", nil, nil, caps) }
func (f *fakeFS) Destroy()         { f.record("Destroy", nil, nil) }

func (f *fakeFS) Lookup(h *gofuse.InHeader, name []byte, out *gofuse.EntryOut) syscall.Errno {
	*out = f.entry
	return f.record("Lookup", *h, strs(name))
}
func (f *fakeFS) Forget(nodeID, nlookup uint64) { f.record("Forget", nil, nil, nodeID, nlookup) }
func (f *fakeFS) GetAttr(in *gofuse.GetAttrIn, out *gofuse.AttrOut) syscall.Errno {
	*out = f.attr
	return f.record("GetAttr", *in, nil)
}
func (f *fakeFS) SetAttr(in *gofuse.SetAttrIn, out *gofuse.AttrOut) syscall.Errno {
	*out = f.attr
	return f.record("SetAttr", *in, nil)
}
func (f *fakeFS) Readlink(h *gofuse.InHeader, buf []byte) (int, syscall.Errno) {
	f.record("Readlink", *h, nil, uint64(len(buf)))
	return copy(buf, f.link), f.errno
}
func (f *fakeFS) Symlink(h *gofuse.InHeader, groups []uint32, sec *SecCtx, target, name []byte, out *gofuse.EntryOut) syscall.Errno {
	*out = f.entry
	return f.record("Symlink", *h, withSec(strs(target, name), sec), groupArgs(groups)...)
}
func (f *fakeFS) Mknod(in *gofuse.MknodIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.EntryOut) syscall.Errno {
	*out = f.entry
	return f.record("Mknod", *in, withSec(strs(name), sec), groupArgs(groups)...)
}
func (f *fakeFS) Mkdir(in *gofuse.MkdirIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.EntryOut) syscall.Errno {
	*out = f.entry
	return f.record("Mkdir", *in, withSec(strs(name), sec), groupArgs(groups)...)
}
func (f *fakeFS) Unlink(h *gofuse.InHeader, name []byte) syscall.Errno {
	return f.record("Unlink", *h, strs(name))
}
func (f *fakeFS) Rmdir(h *gofuse.InHeader, name []byte) syscall.Errno {
	return f.record("Rmdir", *h, strs(name))
}
func (f *fakeFS) Rename(h *gofuse.InHeader, newDir uint64, flags uint32, oldName, newName []byte) syscall.Errno {
	return f.record("Rename", *h, strs(oldName, newName), newDir, uint64(flags))
}
func (f *fakeFS) Link(in *gofuse.LinkIn, name []byte, out *gofuse.EntryOut) syscall.Errno {
	*out = f.entry
	return f.record("Link", *in, strs(name))
}
func (f *fakeFS) Open(in *gofuse.OpenIn, out *gofuse.OpenOut) syscall.Errno {
	*out = f.open
	return f.record("Open", *in, nil)
}
func (f *fakeFS) Create(in *gofuse.CreateIn, groups []uint32, sec *SecCtx, name []byte, out *gofuse.CreateOut) syscall.Errno {
	out.EntryOut, out.OpenOut = f.entry, f.open
	return f.record("Create", *in, withSec(strs(name), sec), groupArgs(groups)...)
}
func (f *fakeFS) Tmpfile(in *gofuse.CreateIn, groups []uint32, sec *SecCtx, out *gofuse.CreateOut) syscall.Errno {
	out.EntryOut, out.OpenOut = f.entry, f.open
	return f.record("Tmpfile", *in, withSec(nil, sec), groupArgs(groups)...)
}
func (f *fakeFS) Read(in *gofuse.ReadIn, dst *bufvec.Vec) (int, syscall.Errno) {
	f.record("Read", *in, nil)
	if f.errno != 0 {
		return 0, f.errno
	}
	if f.readN > 0 {
		return f.readN, 0
	}
	var b []byte
	if in.Offset < uint64(len(f.data)) {
		b = f.data[in.Offset:]
	}
	b = b[:min(len(b), int(in.Size))]
	if err := dst.WriteFull(b); err != nil {
		return 0, syscall.EFAULT
	}
	return len(b), 0
}
func (f *fakeFS) Write(in *gofuse.WriteIn, src *bufvec.Vec) (int, syscall.Errno) {
	f.record("Write", *in, nil)
	if f.errno != 0 {
		return 0, f.errno
	}
	f.written = make([]byte, in.Size)
	if err := src.ReadFull(f.written); err != nil {
		return 0, syscall.EFAULT
	}
	return int(in.Size), 0
}
func (f *fakeFS) Flush(in *gofuse.FlushIn) syscall.Errno { return f.record("Flush", *in, nil) }
func (f *fakeFS) Release(in *gofuse.ReleaseIn)           { f.record("Release", *in, nil) }
func (f *fakeFS) Fsync(in *gofuse.FsyncIn) syscall.Errno { return f.record("Fsync", *in, nil) }
func (f *fakeFS) Fallocate(in *gofuse.FallocateIn) syscall.Errno {
	return f.record("Fallocate", *in, nil)
}
func (f *fakeFS) Lseek(in *gofuse.LseekIn, out *gofuse.LseekOut) syscall.Errno {
	*out = f.lseek
	return f.record("Lseek", *in, nil)
}
func (f *fakeFS) CopyFileRange(in *gofuse.CopyFileRangeIn, limit uint64) (uint64, syscall.Errno) {
	f.record("CopyFileRange", *in, nil, limit)
	return min(f.copied, limit), f.errno
}
func (f *fakeFS) OpenDir(in *gofuse.OpenIn, out *gofuse.OpenOut) syscall.Errno {
	*out = f.open
	return f.record("OpenDir", *in, nil)
}
func (f *fakeFS) ReadDir(in *gofuse.ReadIn, plus bool, emit func(name []byte, ino uint64, typ uint32, off uint64) (*gofuse.EntryOut, bool)) syscall.Errno {
	var p uint64
	if plus {
		p = 1
	}
	f.record("ReadDir", *in, nil, p)
	for i := int(min(in.Offset, uint64(len(f.dirents)))); i < len(f.dirents); i++ {
		if f.dirErrAt > 0 && i >= f.dirErrAt {
			return f.errno
		}
		d := f.dirents[i]
		e, ok := emit([]byte(d.name), d.ino, d.typ, uint64(i+1))
		if !ok {
			break
		}
		if plus {
			if e == nil {
				panic("plus emit returned no EntryOut")
			}
			e.NodeId = d.ino + 1000
			e.Ino = d.ino
			e.Mode = d.typ | 0644
			f.record("ReadDirLookup", nil, nil, d.ino+1000)
		}
	}
	if f.dirErrAt > 0 {
		return 0
	}
	return f.errno
}
func (f *fakeFS) ReleaseDir(in *gofuse.ReleaseIn)           { f.record("ReleaseDir", *in, nil) }
func (f *fakeFS) FsyncDir(in *gofuse.FsyncIn) syscall.Errno { return f.record("FsyncDir", *in, nil) }
func (f *fakeFS) StatFs(h *gofuse.InHeader, out *gofuse.StatfsOut) syscall.Errno {
	*out = f.statfs
	return f.record("StatFs", *h, nil)
}
func (f *fakeFS) Access(in *gofuse.AccessIn) syscall.Errno { return f.record("Access", *in, nil) }
func (f *fakeFS) SyncFs(h *gofuse.InHeader) syscall.Errno {
	return f.record("SyncFs", *h, nil)
}
func (f *fakeFS) Statx(in *gofuse.StatxIn, out *gofuse.StatxOut) syscall.Errno {
	*out = f.statx
	return f.record("Statx", *in, nil)
}
func (f *fakeFS) SetXAttr(in *gofuse.SetXAttrIn, name, value []byte) syscall.Errno {
	return f.record("SetXAttr", *in, strs(name, value))
}
func (f *fakeFS) GetXAttr(h *gofuse.InHeader, name []byte, dst []byte) (int, syscall.Errno) {
	f.record("GetXAttr", *h, strs(name), uint64(len(dst)))
	return xattrCopy(dst, f.xattr, f.errno)
}
func (f *fakeFS) ListXAttr(h *gofuse.InHeader, dst []byte) (int, syscall.Errno) {
	f.record("ListXAttr", *h, nil, uint64(len(dst)))
	return xattrCopy(dst, f.xlist, f.errno)
}

func xattrCopy(dst, v []byte, errno syscall.Errno) (int, syscall.Errno) {
	if errno != 0 {
		return 0, errno
	}
	if len(dst) == 0 {
		return len(v), 0
	}
	if len(dst) < len(v) {
		return 0, syscall.ERANGE
	}
	return copy(dst, v), 0
}
func (f *fakeFS) RemoveXAttr(h *gofuse.InHeader, name []byte) syscall.Errno {
	return f.record("RemoveXAttr", *h, strs(name))
}
func (f *fakeFS) GetLk(in *gofuse.LkIn, out *gofuse.LkOut) syscall.Errno {
	*out = f.lk
	return f.record("GetLk", *in, nil)
}
func (f *fakeFS) SetLk(in *gofuse.LkIn, wait bool) syscall.Errno {
	var w uint64
	if wait {
		w = 1
	}
	return f.record("SetLk", *in, nil, w)
}

func (f *fakeFS) SetupMapping(h *gofuse.InHeader, fh, foffset, length, flags, moffset uint64) syscall.Errno {
	return f.record("SetupMapping", *h, nil, fh, foffset, length, flags, moffset)
}
func (f *fakeFS) RemoveMapping(ranges []MapRange) syscall.Errno {
	args := make([]uint64, 0, 2*len(ranges))
	for _, r := range ranges {
		args = append(args, r.Moffset, r.Len)
	}
	return f.record("RemoveMapping", nil, nil, args...)
}
func (f *fakeFS) WindowSize() uint64 { return f.window }

var (
	_ FileSystem = (*fakeFS)(nil)
	_ Windowed   = (*fakeFS)(nil)
)

// groupArgs records a creation's supplementary groups as call arguments:
// noGroup for none, as the calls of a single group were recorded before
// several were accepted.
func groupArgs(groups []uint32) []uint64 {
	if groups == nil {
		return []uint64{noGroup}
	}
	a := make([]uint64, len(groups))
	for i, g := range groups {
		a[i] = uint64(g)
	}
	return a
}
