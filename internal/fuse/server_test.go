package fuse

import (
	"bytes"
	"encoding/binary"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// The go-fuse structs must have the kernel's sizes (include/uapi/linux/fuse.h):
// the server copies them byte for byte.
func TestWireSizes(t *testing.T) {
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"fuse_in_header", unsafe.Sizeof(gofuse.InHeader{}), InHeaderSize},
		{"fuse_out_header", unsafe.Sizeof(gofuse.OutHeader{}), OutHeaderSize},
		{"fuse_init_in", unsafe.Sizeof(gofuse.InitIn{}) - InHeaderSize, initInSize},
		{"fuse_init_out", unsafe.Sizeof(gofuse.InitOut{}), initOutSize},
		{"fuse_forget_in", unsafe.Sizeof(gofuse.ForgetIn{}) - InHeaderSize, forgetInSize},
		{"fuse_getattr_in", unsafe.Sizeof(gofuse.GetAttrIn{}) - InHeaderSize, getattrInSize},
		{"fuse_setattr_in", unsafe.Sizeof(gofuse.SetAttrIn{}) - InHeaderSize, setattrInSize},
		{"fuse_mknod_in", unsafe.Sizeof(gofuse.MknodIn{}) - InHeaderSize, mknodInSize},
		{"fuse_mkdir_in", unsafe.Sizeof(gofuse.MkdirIn{}) - InHeaderSize, mkdirInSize},
		{"fuse_rename2_in", unsafe.Sizeof(gofuse.RenameIn{}) - InHeaderSize, rename2InSize},
		{"fuse_link_in", unsafe.Sizeof(gofuse.LinkIn{}) - InHeaderSize, linkInSize},
		{"fuse_open_in", unsafe.Sizeof(gofuse.OpenIn{}) - InHeaderSize, openInSize},
		{"fuse_create_in", unsafe.Sizeof(gofuse.CreateIn{}) - InHeaderSize, createInSize},
		{"fuse_read_in", unsafe.Sizeof(gofuse.ReadIn{}) - InHeaderSize, readInSize},
		{"fuse_write_in", unsafe.Sizeof(gofuse.WriteIn{}) - InHeaderSize, writeInSize},
		{"fuse_release_in", unsafe.Sizeof(gofuse.ReleaseIn{}) - InHeaderSize, releaseInSize},
		{"fuse_fsync_in", unsafe.Sizeof(gofuse.FsyncIn{}) - InHeaderSize, fsyncInSize},
		{"fuse_flush_in", unsafe.Sizeof(gofuse.FlushIn{}) - InHeaderSize, flushInSize},
		{"fuse_setxattr_in", unsafe.Sizeof(gofuse.SetXAttrIn{}) - InHeaderSize, setxattrExtSize},
		{"fuse_getxattr_in", unsafe.Sizeof(gofuse.GetXAttrIn{}) - InHeaderSize, getxattrInSize},
		{"fuse_lk_in", unsafe.Sizeof(gofuse.LkIn{}) - InHeaderSize, lkInSize},
		{"fuse_access_in", unsafe.Sizeof(gofuse.AccessIn{}) - InHeaderSize, accessInSize},
		{"fuse_fallocate_in", unsafe.Sizeof(gofuse.FallocateIn{}) - InHeaderSize, fallocInSize},
		{"fuse_lseek_in", unsafe.Sizeof(gofuse.LseekIn{}) - InHeaderSize, lseekInSize},
		{"fuse_copy_file_range_in", unsafe.Sizeof(gofuse.CopyFileRangeIn{}) - InHeaderSize, copyInSize},
		{"fuse_statx_in", unsafe.Sizeof(gofuse.StatxIn{}) - InHeaderSize, statxInSize},
		{"fuse_entry_out", unsafe.Sizeof(gofuse.EntryOut{}), entryOutSize},
		{"fuse_attr_out", unsafe.Sizeof(gofuse.AttrOut{}), attrOutSize},
		{"fuse_open_out", unsafe.Sizeof(gofuse.OpenOut{}), openOutSize},
		{"fuse_create_out", unsafe.Sizeof(gofuse.CreateOut{}), createOutSize},
		{"fuse_statfs_out", unsafe.Sizeof(gofuse.StatfsOut{}), statfsOutSize},
		{"fuse_write_out", unsafe.Sizeof(gofuse.WriteOut{}), writeOutSize},
		{"fuse_getxattr_out", unsafe.Sizeof(gofuse.GetXAttrOut{}), getxattrOutSize},
		{"fuse_lk_out", unsafe.Sizeof(gofuse.LkOut{}), lkOutSize},
		{"fuse_lseek_out", unsafe.Sizeof(gofuse.LseekOut{}), lseekOutSize},
		{"fuse_statx_out", unsafe.Sizeof(gofuse.StatxOut{}), statxOutSize},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d bytes, want %d", c.name, c.got, c.want)
		}
	}
}

// READ and WRITE arguments hand-encoded at the kernel's offsets, so the
// decoding does not rest only on the go-fuse layout.
func TestReadWriteKernelOffsets(t *testing.T) {
	f := newFakeFS()
	_, q := newSession(t, f)
	a := make([]byte, 40)
	binary.LittleEndian.PutUint64(a[0:], 0x0102030405060708) // fh
	binary.LittleEndian.PutUint64(a[8:], 3)                  // offset
	binary.LittleEndian.PutUint32(a[16:], 4)                 // size
	binary.LittleEndian.PutUint32(a[20:], 2)                 // read_flags / write_flags
	binary.LittleEndian.PutUint64(a[24:], 0x99)              // lock_owner
	binary.LittleEndian.PutUint32(a[32:], syscall.O_RDWR)    // flags
	r := serve(t, q, mkreq(OpRead, 3, a, nil, nil), 0, 16+4, 0)
	if !bytes.Equal(r, replyBytes(3, 0, []byte("3456"))) {
		t.Fatalf("READ reply % x", r)
	}
	r = serve(t, q, mkreq(OpWrite, 4, a, nil, []byte("wxyz")), 0, 24, 0)
	if !bytes.Equal(r, replyBytes(4, 0, []byte{4, 0, 0, 0, 0, 0, 0, 0})) {
		t.Fatalf("WRITE reply % x", r)
	}
	calls := f.lastCalls()
	ri, wi := calls[0].In.(gofuse.ReadIn), calls[1].In.(gofuse.WriteIn)
	if ri.Fh != 0x0102030405060708 || ri.Offset != 3 || ri.Size != 4 || ri.ReadFlags != 2 || ri.LockOwner != 0x99 ||
		ri.Flags != syscall.O_RDWR || ri.NodeId != testNode || ri.Uid != testUID || ri.Gid != testGID || ri.Pid != testPID {
		t.Errorf("READ decoded as %+v", ri)
	}
	if wi.Fh != 0x0102030405060708 || wi.Offset != 3 || wi.Size != 4 || wi.WriteFlags != 2 || wi.LockOwner != 0x99 ||
		wi.Flags != syscall.O_RDWR || string(f.written) != "wxyz" {
		t.Errorf("WRITE decoded as %+v, data %q", wi, f.written)
	}
}

// initOut decodes a fuse_init_out by hand.
type initOut struct {
	major, minor, readahead, flags uint32
	maxBackground, congestion      uint16
	maxWrite, timeGran             uint32
	maxPages, mapAlignment         uint16
	flags2                         uint32
	rest                           []byte
}

func decodeInitOut(b []byte) initOut {
	return initOut{
		major: binary.LittleEndian.Uint32(b[0:]), minor: binary.LittleEndian.Uint32(b[4:]),
		readahead: binary.LittleEndian.Uint32(b[8:]), flags: binary.LittleEndian.Uint32(b[12:]),
		maxBackground: binary.LittleEndian.Uint16(b[16:]), congestion: binary.LittleEndian.Uint16(b[18:]),
		maxWrite: binary.LittleEndian.Uint32(b[20:]), timeGran: binary.LittleEndian.Uint32(b[24:]),
		maxPages: binary.LittleEndian.Uint16(b[28:]), mapAlignment: binary.LittleEndian.Uint16(b[30:]),
		flags2: binary.LittleEndian.Uint32(b[32:]), rest: b[36:64],
	}
}

func TestInitNegotiation(t *testing.T) {
	const base = gofuse.CAP_ASYNC_READ | gofuse.CAP_BIG_WRITES | gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_ASYNC_DIO
	for _, tc := range []struct {
		name          string
		major, minor  uint32
		flags, flags2 uint32
		argSize       int
		fsCaps        uint64
		errno         int32
		wantMinor     uint32
		wantFlags     uint32
		wantFlags2    uint32
		wantPages     uint16
		session       bool
	}{
		{name: "7.26 refused", major: 7, minor: 26, flags: kernelInitFlags &^ gofuse.CAP_INIT_EXT, argSize: 16, errno: -int32(syscall.EPROTO)},
		{name: "6.x refused", major: 6, minor: 40, argSize: 16, errno: -int32(syscall.EPROTO)},
		{name: "8.x told to use 7", major: 8, minor: 0, argSize: 64, wantMinor: KernelMinor},
		{name: "7.27 (16-byte init_in)", major: 7, minor: 27, argSize: 16,
			flags:  gofuse.CAP_ASYNC_READ | gofuse.CAP_BIG_WRITES | gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_WRITEBACK_CACHE | gofuse.CAP_SPLICE_READ,
			fsCaps: gofuse.CAP_WRITEBACK_CACHE | gofuse.CAP_POSIX_ACL, wantMinor: 27, session: true,
			wantFlags: gofuse.CAP_ASYNC_READ | gofuse.CAP_BIG_WRITES | gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_WRITEBACK_CACHE},
		{name: "7.31 with MAX_PAGES", major: 7, minor: 31, argSize: 16, flags: base | gofuse.CAP_MAX_PAGES,
			wantMinor: 31, wantFlags: base | gofuse.CAP_MAX_PAGES, wantPages: 256, session: true},
		{name: "7.36 flags2 ignored without INIT_EXT", major: 7, minor: 36, argSize: 64, flags: base,
			flags2: kernelInitFlags2, fsCaps: gofuse.CAP_HAS_EXPIRE_ONLY, wantMinor: 36, wantFlags: base, session: true},
		{name: "7.36 INIT_EXT", major: 7, minor: 36, argSize: 64, flags: base | gofuse.CAP_INIT_EXT,
			flags2: kernelInitFlags2, fsCaps: gofuse.CAP_HAS_EXPIRE_ONLY | gofuse.CAP_SECURITY_CTX | gofuse.CAP_CREATE_SUPP_GROUP,
			wantMinor: 36, wantFlags: base | gofuse.CAP_INIT_EXT,
			wantFlags2: uint32((gofuse.CAP_HAS_EXPIRE_ONLY | gofuse.CAP_SECURITY_CTX | gofuse.CAP_CREATE_SUPP_GROUP) >> 32), session: true},
		{name: "7.38 Linux 6.1", major: 7, minor: 38, argSize: 64, flags: kernelInitFlags, flags2: kernelInitFlags2,
			fsCaps: gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO | gofuse.CAP_SUBMOUNTS | gofuse.CAP_DIRECT_IO_ALLOW_MMAP |
				gofuse.CAP_MAP_ALIGNMENT | gofuse.CAP_SPLICE_MOVE | gofuse.CAP_IOCTL_DIR,
			wantMinor: 38, session: true, wantPages: 256,
			wantFlags: base | gofuse.CAP_MAX_PAGES | gofuse.CAP_INIT_EXT | gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO |
				gofuse.CAP_SUBMOUNTS,
			wantFlags2: uint32(gofuse.CAP_DIRECT_IO_ALLOW_MMAP >> 32)},
		// 6.12 gets 7.41 and ALLOW_IDMAP, which the server asks for
		// itself; never PASSTHROUGH, HAS_RESEND, NO_EXPORT_SUPPORT.
		{name: "7.41 Linux 6.12", major: 7, minor: 41, argSize: 64, flags: kernelInitFlags,
			flags2: kernelInitFlags2 | uint32((gofuse.CAP_PASSTHROUGH|gofuse.CAP_HAS_RESEND|gofuse.CAP_ALLOW_IDMAP|
				gofuse.CAP_NO_EXPORT_SUPPORT)>>32),
			fsCaps:    gofuse.CAP_PASSTHROUGH | gofuse.CAP_HAS_RESEND | gofuse.CAP_NO_EXPORT_SUPPORT | gofuse.CAP_POSIX_LOCKS,
			wantMinor: 41, session: true, wantPages: 256,
			wantFlags:  base | gofuse.CAP_MAX_PAGES | gofuse.CAP_INIT_EXT | gofuse.CAP_POSIX_LOCKS,
			wantFlags2: uint32(gofuse.CAP_ALLOW_IDMAP >> 32)},
		// 7.2 offers 7.45 and every flag up to REQUEST_TIMEOUT: the
		// server takes ALLOW_IDMAP only, whatever the file system asks.
		{name: "7.45 Linux 7.2", major: 7, minor: 45, argSize: 64, flags: kernelInitFlags,
			flags2: kernelInitFlags2 | uint32((gofuse.CAP_PASSTHROUGH|gofuse.CAP_HAS_RESEND|gofuse.CAP_ALLOW_IDMAP|
				gofuse.CAP_NO_EXPORT_SUPPORT|gofuse.CAP_OVER_IO_URING|gofuse.CAP_REQUEST_TIMEOUT)>>32),
			fsCaps: gofuse.CAP_PASSTHROUGH | gofuse.CAP_HAS_RESEND | gofuse.CAP_NO_EXPORT_SUPPORT | gofuse.CAP_OVER_IO_URING |
				gofuse.CAP_REQUEST_TIMEOUT | gofuse.CAP_DIRECT_IO_ALLOW_MMAP,
			wantMinor: 45, session: true, wantPages: 256,
			wantFlags:  base | gofuse.CAP_MAX_PAGES | gofuse.CAP_INIT_EXT,
			wantFlags2: uint32((gofuse.CAP_ALLOW_IDMAP | gofuse.CAP_DIRECT_IO_ALLOW_MMAP) >> 32)},
		{name: "7.46 answered 7.45", major: 7, minor: 46, argSize: 64, flags: base,
			wantMinor: 45, session: true, wantFlags: base},
		{name: "7.40 offering ALLOW_IDMAP", major: 7, minor: 40, argSize: 64, flags: base | gofuse.CAP_INIT_EXT,
			flags2: uint32(gofuse.CAP_ALLOW_IDMAP >> 32), wantMinor: 40, session: true, wantFlags: base | gofuse.CAP_INIT_EXT,
			wantFlags2: uint32(gofuse.CAP_ALLOW_IDMAP >> 32)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeFS()
			f.caps = tc.fsCaps
			s := NewServer(f, ServerOptions{}, debugLogger())
			q := s.Queue(1)
			r := serve(t, q, initReq(77, tc.major, tc.minor, tc.flags, tc.flags2, tc.argSize), 1, 80, 3)
			if tc.errno != 0 {
				if !bytes.Equal(r, replyBytes(77, tc.errno, nil)) {
					t.Fatalf("reply % x, want error %d", r, tc.errno)
				}
			} else {
				if len(r) != 80 || errnoOf(r) != 0 || binary.LittleEndian.Uint64(r[8:]) != 77 {
					t.Fatalf("reply % x", r)
				}
				o := decodeInitOut(r[16:])
				want := initOut{major: 7, minor: tc.wantMinor, rest: make([]byte, 28)}
				if tc.major == 7 {
					want.readahead = 128 << 10
					want.flags, want.flags2 = tc.wantFlags, tc.wantFlags2
					want.maxBackground, want.congestion = DefaultMaxBackground, DefaultCongestionThreshold
					want.maxWrite, want.timeGran, want.maxPages = 1<<20, 1, tc.wantPages
				}
				if !reflect.DeepEqual(o, want) {
					t.Fatalf("init_out\n got %+v\nwant %+v", o, want)
				}
			}
			var wantCalls []fsCall
			if tc.session {
				wantCalls = []fsCall{{Op: "Init", Args: []uint64{uint64(tc.wantFlags) | uint64(tc.wantFlags2)<<32}}}
			}
			if calls := f.lastCalls(); !reflect.DeepEqual(calls, wantCalls) {
				t.Fatalf("calls %+v, want %+v", calls, wantCalls)
			}
			// Without a session every request is EIO.
			r = serve(t, q, mkreq(OpGetattr, 78, make([]byte, 16), nil, nil), 0, 16+attrOutSize, 0)
			if got, want := errnoOf(r), int32(0); tc.session && got != want || !tc.session && got != -int32(syscall.EIO) {
				t.Fatalf("GETATTR after INIT: error %d (session %v)", got, tc.session)
			}
		})
	}
}

func TestSessionLifecycle(t *testing.T) {
	f := newFakeFS()
	s := NewServer(f, ServerOptions{}, debugLogger())
	q, q2 := s.Queue(1), s.Queue(2)
	getattr := func(q *Queue) int32 {
		return errnoOf(serve(t, q, mkreq(OpGetattr, 5, make([]byte, 16), nil, nil), 0, 16+attrOutSize, 0))
	}
	init := func(q *Queue) {
		if r := serve(t, q, initReq(1, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0); errnoOf(r) != 0 {
			t.Fatalf("INIT: % x", r)
		}
	}
	// Before INIT: EIO; FORGET and INTERRUPT are dropped silently.
	if e := getattr(q); e != -int32(syscall.EIO) {
		t.Fatalf("GETATTR before INIT: %d", e)
	}
	if r := serve(t, q, mkreq(OpDestroy, 2, nil, nil, nil), 0, 16, 0); errnoOf(r) != -int32(syscall.EIO) {
		t.Fatalf("DESTROY before INIT: % x", r)
	}
	if r := serve(t, q, mkreq(OpForget, 2, make([]byte, 8), nil, nil), 0, 0, 0); len(r) != 0 {
		t.Fatalf("FORGET before INIT replied % x", r)
	}
	if len(f.lastCalls()) != 0 {
		t.Fatalf("calls before INIT: %+v", f.lastCalls())
	}
	init(q)
	if e := getattr(q2); e != 0 {
		t.Fatalf("GETATTR on another queue after INIT: %d", e)
	}
	// A second INIT (guest reset) starts a new session: Init again.
	init(q2)
	if e := getattr(q); e != 0 {
		t.Fatalf("GETATTR after re-INIT: %d", e)
	}
	// DESTROY ends it; then EIO until the next INIT (umount + mount).
	if r := serve(t, q, mkreq(OpDestroy, 9, nil, nil, nil), 1, 16, 0); !bytes.Equal(r, replyBytes(9, 0, nil)) {
		t.Fatalf("DESTROY reply % x", r)
	}
	if e := getattr(q2); e != -int32(syscall.EIO) {
		t.Fatalf("GETATTR after DESTROY: %d", e)
	}
	init(q)
	if e := getattr(q2); e != 0 {
		t.Fatalf("GETATTR after INIT following DESTROY: %d", e)
	}
	var ops []string
	for _, c := range f.lastCalls() {
		ops = append(ops, c.Op)
	}
	if got, want := strings.Join(ops, " "), "Init GetAttr Init GetAttr Destroy Init GetAttr"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
}

func TestMalformed(t *testing.T) {
	einval := -int32(syscall.EINVAL)
	lenMismatch := mkreq(OpGetattr, 1, make([]byte, 16), nil, nil)
	binary.LittleEndian.PutUint32(lenMismatch, 60)
	extlen := mkreq(OpLookup, 1, nil, []string{"x"}, make([]byte, 8))
	binary.LittleEndian.PutUint16(extlen[36:], 1)
	hugeWrite := make([]byte, 1<<20+1)
	for _, tc := range []struct {
		name    string
		req     []byte
		outSize int
		errno   int32 // 1: no reply at all
		calls   int
	}{
		{"short header", make([]byte, 39), 16, 1, 0},
		{"empty request", nil, 16, 1, 0},
		{"len larger than chain", lenMismatch, 16 + attrOutSize, einval, 0},
		{"len smaller than chain", append(mkreq(OpGetattr, 1, make([]byte, 16), nil, nil), 0), 16 + attrOutSize, einval, 0},
		{"total_extlen set", extlen, 16 + entryOutSize, einval, 0},
		{"no room for out header", mkreq(OpGetattr, 1, make([]byte, 16), nil, nil), 15, 1, 0},
		{"no room for attr_out", mkreq(OpGetattr, 1, make([]byte, 16), nil, nil), 16 + attrOutSize - 1, einval, 0},
		{"no room for entry_out: no lookup", mkreq(OpLookup, 1, nil, []string{"x"}, nil), 16, einval, 0},
		{"short getattr_in", mkreq(OpGetattr, 1, make([]byte, 15), nil, nil), 16 + attrOutSize, einval, 0},
		{"short setattr_in", mkreq(OpSetattr, 1, make([]byte, 87), nil, nil), 16 + attrOutSize, einval, 0},
		{"lookup without NUL", mkreq(OpLookup, 1, nil, nil, []byte("abc")), 16 + entryOutSize, einval, 0},
		{"lookup without name", mkreq(OpLookup, 1, nil, nil, nil), 16 + entryOutSize, einval, 0},
		{"lookup with NUL inside", mkreq(OpLookup, 1, nil, nil, []byte("a\x00b\x00")), 16 + entryOutSize, einval, 0},
		{"lookup name past NUL", mkreq(OpLookup, 1, nil, []string{"a"}, []byte("b")), 16 + entryOutSize, einval, 0},
		{"rename with one name", mkreq(OpRename, 1, make([]byte, 8), []string{"a"}, nil), 16, einval, 0},
		{"rename second name unterminated", mkreq(OpRename, 1, make([]byte, 8), []string{"a"}, []byte("b")), 16, einval, 0},
		{"symlink one name", mkreq(OpSymlink, 1, nil, []string{"a"}, nil), 16 + entryOutSize, einval, 0},
		{"mkdir without name", mkreq(OpMkdir, 1, make([]byte, 8), nil, nil), 16 + entryOutSize, einval, 0},
		{"setxattr without NUL", mkreq(OpSetxattr, 1, argBytes(gofuse.SetXAttrIn{Size: 1}, 16), nil, []byte("abc")), 16, einval, 0},
		{"setxattr value shorter than size", mkreq(OpSetxattr, 1, argBytes(gofuse.SetXAttrIn{Size: 9}, 16), []string{"user.a"}, []byte("abc")), 16, einval, 0},
		{"setxattr value longer than size", mkreq(OpSetxattr, 1, argBytes(gofuse.SetXAttrIn{Size: 1}, 16), []string{"user.a"}, []byte("abc")), 16, einval, 0},
		{"write size larger than data", mkreq(OpWrite, 1, argBytes(gofuse.WriteIn{Size: 10}, 40), nil, make([]byte, 9)), 24, einval, 0},
		{"write size smaller than data", mkreq(OpWrite, 1, argBytes(gofuse.WriteIn{Size: 8}, 40), nil, make([]byte, 9)), 24, einval, 0},
		{"write over max_write", mkreq(OpWrite, 1, argBytes(gofuse.WriteIn{Size: uint32(len(hugeWrite))}, 40), nil, hugeWrite), 24, einval, 0},
		{"write without room for write_out", mkreq(OpWrite, 1, argBytes(gofuse.WriteIn{Size: 1}, 40), nil, []byte{1}), 23, einval, 0},
		{"short write_in", mkreq(OpWrite, 1, make([]byte, 39), nil, nil), 24, einval, 0},
		{"short read_in", mkreq(OpRead, 1, make([]byte, 30), nil, nil), 4096, einval, 0},
		{"short forget_in", mkreq(OpForget, 1, make([]byte, 7), nil, nil), 0, 1, 0},
		{"batch forget without header", mkreq(OpBatchForget, 1, make([]byte, 4), nil, nil), 0, 1, 0},
		{"syncfs without syncfs_in", mkreq(OpSyncfs, 1, nil, nil, nil), 16, einval, 0},
		{"init short", mkreq(OpInit, 1, make([]byte, 15), nil, nil), 80, einval, 0},
		{"init without room", initReq(1, 7, 38, 0, 0, 64), 79, einval, 0},
		{"name region too big", mkreq(OpLookup, 1, nil, nil, append(make([]byte, maxNameRegion), 0)), 16 + entryOutSize, einval, 0},
		{"readlink target larger than room", mkreq(OpReadlink, 1, nil, nil, nil), 20, -int32(syscall.ENAMETOOLONG), 1},
		{"getxattr with size but no room", mkreq(OpGetxattr, 1, argBytes(gofuse.GetXAttrIn{Size: 10}, 8), []string{"user.a"}, nil), 16, -int32(syscall.ERANGE), 0},
		{"getxattr size 0 without room", mkreq(OpGetxattr, 1, argBytes(gofuse.GetXAttrIn{}, 8), []string{"user.a"}, nil), 23, einval, 0},
		{"statx without room", mkreq(OpStatx, 1, make([]byte, 24), nil, nil), 16 + statxOutSize - 1, einval, 0},
		{"create without room", mkreq(OpCreate, 1, make([]byte, 16), []string{"n"}, nil), 16 + entryOutSize, einval, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeFS()
			_, q := newSession(t, f)
			r := serve(t, q, tc.req, 0, tc.outSize, 0)
			if got := errnoOf(r); got != tc.errno {
				t.Fatalf("error %d, want %d (reply % x)", got, tc.errno, r)
			}
			if len(r) > OutHeaderSize {
				t.Fatalf("error reply with payload: % x", r)
			}
			if n := len(f.lastCalls()); n != tc.calls {
				t.Fatalf("%d file system calls (%+v), want %d", n, f.lastCalls(), tc.calls)
			}
		})
	}
}

func TestReadClampsToRoom(t *testing.T) {
	f := newFakeFS()
	_, q := newSession(t, f)
	req := mkreq(OpRead, 1, argBytes(gofuse.ReadIn{Size: 1 << 20}, 40), nil, nil)
	r := serve(t, q, req, 0, 16+10, 3)
	if !bytes.Equal(r, replyBytes(1, 0, f.data[:10])) {
		t.Fatalf("reply % x", r)
	}
	if got := f.lastCalls()[0].In.(gofuse.ReadIn).Size; got != 10 {
		t.Fatalf("file system asked for %d bytes, want 10", got)
	}
	// A file system claiming more than it was asked for is an EIO.
	f.readN = 11
	if r := serve(t, q, req, 0, 16+10, 0); errnoOf(r) != -int32(syscall.EIO) || len(r) != 16 {
		t.Fatalf("reply % x", r)
	}
	// Errors replace the data.
	f.readN, f.errno = 0, syscall.EBADF
	if r := serve(t, q, req, 0, 16+10, 1); !bytes.Equal(r, replyBytes(1, -int32(syscall.EBADF), nil)) {
		t.Fatalf("reply % x", r)
	}
}

// A READ reply in unmapped memory: header must stay in mapped memory; the
// file system sees the segments (it bounces them), the server never
// touches them.
func TestUnmappedArgs(t *testing.T) {
	f := newFakeFS()
	_, q := newSession(t, f)
	req := mkreq(OpLookup, 1, nil, []string{"name"}, nil)
	in := bufvec.NewVec(2)
	_ = in.Append(bufvec.Segment{Buf: req[:InHeaderSize], Len: InHeaderSize})
	_ = in.Append(bufvec.Segment{GPA: 0x1000, Len: uint32(len(req) - InHeaderSize)})
	out := make([]byte, 16+entryOutSize)
	n := q.Serve(in, vecOf(out))
	if n != 16 || errnoOf(out) != -int32(syscall.EFAULT) {
		t.Fatalf("reply % x", out[:n])
	}
}

func TestReaddirLimits(t *testing.T) {
	many := make([]fakeDirent, 0, 300)
	for i := range 300 {
		many = append(many, fakeDirent{name: strings.Repeat("n", i%40+1), ino: uint64(i + 2), typ: syscall.S_IFREG})
	}
	t.Run("size limits entries", func(t *testing.T) {
		f := newFakeFS()
		f.dirents = testDirents
		_, q := newSession(t, f)
		// 32 + 32 bytes fit in 70; the third (32) does not.
		r := serve(t, q, mkreq(OpReaddir, 1, argBytes(gofuse.ReadIn{Size: 70}, 40), nil, nil), 1, 16+4096, 5)
		if want := replyBytes(1, 0, append(dirent(1, 1, 4, "."), dirent(1, 2, 4, "..")...)); !bytes.Equal(r, want) {
			t.Fatalf("reply\n got % x\nwant % x", r, want)
		}
	})
	t.Run("room limits entries", func(t *testing.T) {
		f := newFakeFS()
		f.dirents = testDirents
		_, q := newSession(t, f)
		r := serve(t, q, mkreq(OpReaddirplus, 1, argBytes(gofuse.ReadIn{Size: 4096}, 40), nil, nil), 0, 16+160+159, 1)
		if want := replyBytes(1, 0, direntplus(1, 1, 4, ".")); !bytes.Equal(r, want) {
			t.Fatalf("reply\n got % x\nwant % x", r, want)
		}
		// Only the entry that was delivered was looked up.
		if calls := f.lastCalls(); len(calls) != 2 || calls[1].Op != "ReadDirLookup" {
			t.Fatalf("calls %+v", calls)
		}
	})
	t.Run("many entries, bytewise reply", func(t *testing.T) {
		f := newFakeFS()
		f.dirents = many
		_, q := newSession(t, f)
		off := uint64(0)
		var names int
		for round := 0; ; round++ {
			r := serve(t, q, mkreq(OpReaddir, 1, argBytes(gofuse.ReadIn{Offset: off, Size: 4096}, 40), nil, nil), 0, 16+4096, 1+round%5)
			if errnoOf(r) != 0 {
				t.Fatalf("error %d", errnoOf(r))
			}
			p := r[16:]
			if len(p) == 0 {
				break
			}
			for len(p) > 0 {
				nl := int(binary.LittleEndian.Uint32(p[16:]))
				name := string(p[24 : 24+nl])
				if want := many[names].name; name != want {
					t.Fatalf("entry %d: %q, want %q", names, name, want)
				}
				off = binary.LittleEndian.Uint64(p[8:])
				names++
				p = p[align8(24+nl):]
			}
		}
		if names != len(many) {
			t.Fatalf("listed %d entries, want %d", names, len(many))
		}
	})
	t.Run("error after entries delivers them", func(t *testing.T) {
		f := newFakeFS()
		f.dirents, f.dirErrAt, f.errno = testDirents, 1, syscall.EIO
		_, q := newSession(t, f)
		r := serve(t, q, mkreq(OpReaddir, 1, argBytes(gofuse.ReadIn{Size: 4096}, 40), nil, nil), 0, 16+4096, 0)
		if want := replyBytes(1, 0, dirent(1, 1, 4, ".")); !bytes.Equal(r, want) {
			t.Fatalf("reply % x", r)
		}
		r = serve(t, q, mkreq(OpReaddir, 2, argBytes(gofuse.ReadIn{Offset: 1, Size: 4096}, 40), nil, nil), 0, 16+4096, 0)
		if want := replyBytes(2, -int32(syscall.EIO), nil); !bytes.Equal(r, want) {
			t.Fatalf("reply % x", r)
		}
	})
	t.Run("unmapped reply drops the lookup", func(t *testing.T) {
		f := newFakeFS()
		f.dirents = testDirents
		_, q := newSession(t, f)
		req := mkreq(OpReaddirplus, 1, argBytes(gofuse.ReadIn{Size: 4096}, 40), nil, nil)
		buf := make([]byte, 16+160)
		ov := bufvec.NewVec(3)
		_ = ov.Append(bufvec.Segment{Buf: buf, Len: uint32(len(buf))})
		_ = ov.Append(bufvec.Segment{GPA: 0x10000, Len: 4096})
		n := q.Serve(vecOf(req), ov)
		if want := replyBytes(1, 0, direntplus(1, 1, 4, ".")); !bytes.Equal(buf[:n], want) {
			t.Fatalf("reply % x", buf[:n])
		}
		calls := f.lastCalls()
		last := calls[len(calls)-1]
		if last.Op != "Forget" || !reflect.DeepEqual(last.Args, []uint64{1001, 1}) {
			t.Fatalf("calls %+v: want the undelivered entry forgotten", calls)
		}
	})
}

// The debug line is parsed by the e2e test: keep its keys and order.
func TestDebugLogLine(t *testing.T) {
	var buf bytes.Buffer
	var mu sync.Mutex
	h := slog.NewTextHandler(&lockedWriter{w: &buf, mu: &mu}, &slog.HandlerOptions{Level: slog.LevelDebug})
	f := newFakeFS()
	s := NewServer(f, ServerOptions{}, slog.New(h))
	q := s.Queue(3)
	serve(t, q, initReq(11, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)
	serve(t, q, mkreq(OpLookup, 12, nil, []string{"x"}, nil), 0, 16, 0)
	serve(t, q, mkreq(OpForget, 13, make([]byte, 8), nil, nil), 0, 0, 0)
	var lines []string
	for _, l := range strings.Split(buf.String(), "\n") {
		if strings.Contains(l, `msg="fuse request"`) {
			lines = append(lines, l[strings.Index(l, "msg="):strings.Index(l, " latency=")])
		}
	}
	want := []string{
		`msg="fuse request" queue=3 unique=11 opcode=INIT nodeid=5 len=104 error=0`,
		`msg="fuse request" queue=3 unique=12 opcode=LOOKUP nodeid=5 len=42 error=-22`,
		`msg="fuse request" queue=3 unique=13 opcode=FORGET nodeid=5 len=48 error=0`,
	}
	if !reflect.DeepEqual(lines, want) {
		t.Fatalf("log lines\n got %q\nwant %q", lines, want)
	}
}

type lockedWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// Queues serve concurrently (run with -race): per-queue scratch, the
// session read atomically, INIT and DESTROY serialised.
func TestConcurrentQueues(t *testing.T) {
	f := newFakeFS()
	s, _ := newSession(t, f)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			q := s.Queue(i + 1)
			for j := range 300 {
				var r []byte
				switch j % 4 {
				case 0:
					r = serve(t, q, mkreq(OpGetattr, uint64(j), make([]byte, 16), nil, nil), 0, 16+attrOutSize, 0)
				case 1:
					r = serve(t, q, mkreq(OpRead, uint64(j), argBytes(gofuse.ReadIn{Size: 8}, 40), nil, nil), 3, 24, 2)
				case 2:
					r = serve(t, q, mkreq(OpLookup, uint64(j), nil, []string{"some-name"}, nil), 1, 16+entryOutSize, 0)
				case 3:
					if i == 0 && j%60 == 3 {
						r = serve(t, q, initReq(uint64(j), 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)
					} else {
						r = serve(t, q, mkreq(OpStatfs, uint64(j), nil, nil, nil), 0, 16+statfsOutSize, 0)
					}
				}
				if e := errnoOf(r); e != 0 && e != -int32(syscall.EIO) {
					t.Errorf("queue %d request %d: error %d", i, j, e)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// TestUniqueZero: unique 0 marks a notification in the device-to-driver
// direction, never a request; a guest that sends one anyway gets an answer
// like any other (its unique echoed) and the queue keeps serving.
func TestUniqueZero(t *testing.T) {
	f := newFakeFS()
	_, q := newSession(t, f)
	for _, op := range []uint32{OpGetattr, OpForget, OpLookup} {
		var args []byte
		var names []string
		switch op {
		case OpGetattr:
			args = make([]byte, 16)
		case OpForget:
			args = make([]byte, 8)
		case OpLookup:
			names = []string{"x"}
		}
		r := serve(t, q, mkreq(op, 0, args, names, nil), 0, 256, 0)
		if op == OpForget {
			if len(r) != 0 {
				t.Errorf("FORGET with unique 0 answered: % x", r)
			}
			continue
		}
		if len(r) < OutHeaderSize || binary.LittleEndian.Uint64(r[8:]) != 0 {
			t.Errorf("%s with unique 0: reply % x", OpName(op), r)
		}
	}
	if r := serve(t, q, mkreq(OpGetattr, 7, make([]byte, 16), nil, nil), 0, 256, 0); errnoOf(r) != 0 {
		t.Fatalf("GETATTR after unique-0 requests: error %d", errnoOf(r))
	}
}

// TestClassify: the ring's servers learn from Classify which requests are
// worth a second core and which node a large WRITE writes; it only peeks.
func TestClassify(t *testing.T) {
	q := NewServer(newFakeFS(), ServerOptions{}, quietLogger()).Queue(1)
	rw := func(size uint32) []byte {
		a := make([]byte, 40)
		binary.LittleEndian.PutUint32(a[16:], size)
		return a
	}
	for _, tc := range []struct {
		name  string
		req   []byte
		sizes []int // segment split of the request
		heavy bool
		node  uint64
		slow  bool
	}{
		{"write 1M", mkreq(OpWrite, 1, rw(1<<20), nil, make([]byte, 1<<20)), []int{40, 40}, true, testNode, false},
		{"write at threshold", mkreq(OpWrite, 1, rw(heavyBytes-80), nil, make([]byte, heavyBytes-80)), nil, true, testNode, false},
		{"write 4k", mkreq(OpWrite, 1, rw(4096), nil, make([]byte, 4096)), []int{40, 40}, false, 0, false},
		{"read 1M", mkreq(OpRead, 1, rw(1<<20), nil, nil), []int{40}, true, 0, false},
		{"read 4k", mkreq(OpRead, 1, rw(4096), nil, nil), nil, false, 0, false},
		{"getattr", mkreq(OpGetattr, 1, make([]byte, 16), nil, nil), nil, false, 0, false},
		{"fsync", mkreq(OpFsync, 1, make([]byte, 16), nil, nil), nil, false, 0, true},
		{"fsync split", mkreq(OpFsync, 1, make([]byte, 16), nil, nil), []int{3, 50}, false, 0, true},
		{"flush", mkreq(OpFlush, 1, make([]byte, 24), nil, nil), nil, false, 0, true},
		{"fallocate", mkreq(OpFallocate, 1, make([]byte, 32), nil, nil), nil, false, 0, true},
		{"syncfs", mkreq(OpSyncfs, 1, make([]byte, 8), nil, nil), nil, false, 0, true},
		{"short header", make([]byte, 30), nil, false, 0, false},
		{"header only", mkreq(OpRead, 1, nil, nil, nil), nil, false, 0, false},
		{"split header", mkreq(OpWrite, 1, rw(1<<20), nil, make([]byte, 1<<20)), []int{7, 13, 29}, true, testNode, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := vecOf(tc.req, tc.sizes...)
			heavy, node, slow := q.Classify(in)
			if heavy != tc.heavy || node != tc.node || slow != tc.slow {
				t.Errorf("Classify = %v, %d, %v; want %v, %d, %v", heavy, node, slow, tc.heavy, tc.node, tc.slow)
			}
			if in.Pos() != 0 {
				t.Errorf("cursor left at %d", in.Pos())
			}
		})
	}
}
