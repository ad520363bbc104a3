package vmm

import (
	"fmt"
	"sync/atomic"
	"syscall"
)

// FUSE wire sizes.
const (
	FuseInHeaderSize  = 40
	FuseOutHeaderSize = 16
	FuseAttrSize      = 88
	FuseEntryOutSize  = 40 + FuseAttrSize
	FuseAttrOutSize   = 16 + FuseAttrSize
	FuseInitInSize    = 64 // minor >= 36; 16 before
	FuseInitOutSize   = 64
)

// FUSE opcodes.
const (
	OpLookup        = 1
	OpForget        = 2
	OpGetattr       = 3
	OpSetattr       = 4
	OpReadlink      = 5
	OpSymlink       = 6
	OpMknod         = 8
	OpMkdir         = 9
	OpUnlink        = 10
	OpRmdir         = 11
	OpRename        = 12
	OpLink          = 13
	OpOpen          = 14
	OpRead          = 15
	OpWrite         = 16
	OpStatfs        = 17
	OpRelease       = 18
	OpFsync         = 20
	OpSetxattr      = 21
	OpGetxattr      = 22
	OpListxattr     = 23
	OpRemovexattr   = 24
	OpFlush         = 25
	OpInit          = 26
	OpOpendir       = 27
	OpReaddir       = 28
	OpReleasedir    = 29
	OpFsyncdir      = 30
	OpGetlk         = 31
	OpSetlk         = 32
	OpSetlkw        = 33
	OpAccess        = 34
	OpCreate        = 35
	OpInterrupt     = 36
	OpBmap          = 37
	OpDestroy       = 38
	OpIoctl         = 39
	OpPoll          = 40
	OpNotifyReply   = 41
	OpBatchForget   = 42
	OpFallocate     = 43
	OpReaddirplus   = 44
	OpRename2       = 45
	OpLseek         = 46
	OpCopyFileRange = 47
	OpSetupmapping  = 48
	OpRemovemapping = 49
	OpSyncfs        = 50
	OpTmpfile       = 51
	OpStatx         = 52
	// OpCopyFileRange64 (7.45) takes COPY_FILE_RANGE's arguments and
	// answers fuse_copy_file_range_out { u64 bytes_copied }.
	OpCopyFileRange64 = 53
)

// InvalidUIDGID is FUSE_INVALID_UIDGID: the uid and gid of a request that
// creates nothing once FUSE_ALLOW_IDMAP is negotiated.
const InvalidUIDGID = ^uint32(0)

// RootID is the FUSE node id of the root directory.
const RootID = 1

// FUSE_INIT flags (flags2 is the upper half).
const (
	InitAsyncRead         = 1 << 0
	InitPosixLocks        = 1 << 1
	InitAtomicOTrunc      = 1 << 3
	InitExportSupport     = 1 << 4
	InitBigWrites         = 1 << 5
	InitDontMask          = 1 << 6
	InitSpliceWrite       = 1 << 7
	InitSpliceMove        = 1 << 8
	InitSpliceRead        = 1 << 9
	InitFlockLocks        = 1 << 10
	InitHasIoctlDir       = 1 << 11
	InitAutoInvalData     = 1 << 12
	InitDoReaddirplus     = 1 << 13
	InitReaddirplusAuto   = 1 << 14
	InitAsyncDio          = 1 << 15
	InitWritebackCache    = 1 << 16
	InitNoOpenSupport     = 1 << 17
	InitParallelDirops    = 1 << 18
	InitHandleKillpriv    = 1 << 19
	InitPosixACL          = 1 << 20
	InitAbortError        = 1 << 21
	InitMaxPages          = 1 << 22
	InitCacheSymlinks     = 1 << 23
	InitNoOpendirSupport  = 1 << 24
	InitExplicitInvalData = 1 << 25
	InitMapAlignment      = 1 << 26
	InitSubmounts         = 1 << 27
	InitHandleKillprivV2  = 1 << 28
	InitSetxattrExt       = 1 << 29
	InitInitExt           = 1 << 30
	InitSecurityCtx       = 1 << 32
	InitHasInodeDax       = 1 << 33
	InitCreateSuppGroup   = 1 << 34
	InitHasExpireOnly     = 1 << 35
	InitDirectIOAllowMmap = 1 << 36
	InitPassthrough       = 1 << 37
	InitNoExportSupport   = 1 << 38
	InitHasResend         = 1 << 39
	InitAllowIdmap        = 1 << 40
	InitOverIOURing       = 1 << 41
	InitRequestTimeout    = 1 << 42
)

// Linux72InitFlags is what Linux 7.2 offers on a virtiofs mount (FUSE
// 7.45): 6.1's, then what 6.2 to 7.2 added (CREATE_SUPP_GROUP,
// HAS_EXPIRE_ONLY, DIRECT_IO_ALLOW_MMAP, NO_EXPORT_SUPPORT, HAS_RESEND,
// ALLOW_IDMAP, REQUEST_TIMEOUT).
const Linux72InitFlags = LinuxInitFlags | InitCreateSuppGroup | InitHasExpireOnly | InitDirectIOAllowMmap |
	InitNoExportSupport | InitHasResend | InitAllowIdmap | InitRequestTimeout

// Linux72Minor is the protocol minor Linux 7.2 speaks.
const Linux72Minor = 45

// LinuxInitFlags is what Linux 6.1's fuse_send_init offers on a virtiofs
// mount (no DAX; virtiofs sets auto_submounts).
const LinuxInitFlags = InitAsyncRead | InitPosixLocks | InitAtomicOTrunc | InitExportSupport |
	InitBigWrites | InitDontMask | InitSpliceWrite | InitSpliceMove | InitSpliceRead |
	InitFlockLocks | InitHasIoctlDir | InitAutoInvalData | InitDoReaddirplus |
	InitReaddirplusAuto | InitAsyncDio | InitWritebackCache | InitNoOpenSupport |
	InitParallelDirops | InitHandleKillpriv | InitPosixACL | InitAbortError | InitMaxPages |
	InitCacheSymlinks | InitNoOpendirSupport | InitExplicitInvalData | InitSubmounts |
	InitHandleKillprivV2 | InitSetxattrExt | InitInitExt | InitSecurityCtx

// Kernel FUSE protocol version used by default (Linux 6.1 stable).
const (
	KernelMajor = 7
	KernelMinor = 38
)

// InHeader is struct fuse_in_header.
type InHeader struct {
	Len         uint32
	Opcode      uint32
	Unique      uint64
	NodeID      uint64
	UID, GID    uint32
	PID         uint32
	TotalExtlen uint16
	Padding     uint16
}

// Bytes encodes the header.
func (h InHeader) Bytes() []byte {
	b := le.AppendUint32(nil, h.Len)
	b = le.AppendUint32(b, h.Opcode)
	b = le.AppendUint64(b, h.Unique)
	b = le.AppendUint64(b, h.NodeID)
	b = le.AppendUint32(b, h.UID)
	b = le.AppendUint32(b, h.GID)
	b = le.AppendUint32(b, h.PID)
	b = le.AppendUint16(b, h.TotalExtlen)
	return le.AppendUint16(b, h.Padding)
}

// BuildRequest encodes h followed by args, setting h.Len to the total
// including dataLen (WRITE data travelling in separate page segments).
func BuildRequest(h InHeader, dataLen int, args ...[]byte) []byte {
	n := FuseInHeaderSize + dataLen
	for _, a := range args {
		n += len(a)
	}
	h.Len = uint32(n)
	b := h.Bytes()
	for _, a := range args {
		b = append(b, a...)
	}
	return b
}

// OutHeader is struct fuse_out_header.
type OutHeader struct {
	Len    uint32
	Error  int32
	Unique uint64
}

// ParseReply splits a reply into its header and body, checking that the
// header's len equals the bytes the device reported writing.
func ParseReply(b []byte) (OutHeader, []byte, error) {
	if len(b) < FuseOutHeaderSize {
		return OutHeader{}, nil, fmt.Errorf("vmm: FUSE reply of %d bytes", len(b))
	}
	h := OutHeader{le.Uint32(b), int32(le.Uint32(b[4:])), le.Uint64(b[8:])}
	if int(h.Len) != len(b) {
		return h, nil, fmt.Errorf("vmm: fuse_out_header.len %d but used length %d", h.Len, len(b))
	}
	return h, b[FuseOutHeaderSize:], nil
}

// FuseError is a FUSE reply with a non-zero error.
type FuseError struct {
	Opcode uint32
	Errno  syscall.Errno
}

func (e *FuseError) Error() string { return fmt.Sprintf("vmm: FUSE opcode %d: %v", e.Opcode, e.Errno) }

func (e *FuseError) Unwrap() error { return e.Errno }

// InitIn is struct fuse_init_in.
type InitIn struct {
	Major, Minor, MaxReadahead uint32
	Flags                      uint64 // low half in flags, high half in flags2
}

// Bytes encodes it: 16 bytes before 7.36, 64 bytes from 7.36 on.
func (i InitIn) Bytes() []byte {
	b := le.AppendUint32(nil, i.Major)
	b = le.AppendUint32(b, i.Minor)
	b = le.AppendUint32(b, i.MaxReadahead)
	b = le.AppendUint32(b, uint32(i.Flags))
	if i.Minor < 36 {
		return b
	}
	b = le.AppendUint32(b, uint32(i.Flags>>32))
	return append(b, make([]byte, 44)...)
}

// InitOut is struct fuse_init_out.
type InitOut struct {
	Major, Minor, MaxReadahead uint32
	Flags                      uint64 // flags | flags2<<32
	MaxBackground              uint16
	CongestionThreshold        uint16
	MaxWrite, TimeGran         uint32
	MaxPages, MapAlignment     uint16
	RequestTimeout             uint16 // seconds, with InitRequestTimeout (7.43)
	Size                       int    // bytes of the reply body
}

// ParseInitOut decodes a fuse_init_out body (24 bytes for very old servers,
// 64 bytes today).
func ParseInitOut(b []byte) (*InitOut, error) {
	if len(b) < 8 {
		return nil, fmt.Errorf("vmm: fuse_init_out of %d bytes", len(b))
	}
	o := &InitOut{Major: le.Uint32(b), Minor: le.Uint32(b[4:]), Size: len(b)}
	if len(b) >= 24 {
		o.MaxReadahead = le.Uint32(b[8:])
		o.Flags = uint64(le.Uint32(b[12:]))
		o.MaxBackground = le.Uint16(b[16:])
		o.CongestionThreshold = le.Uint16(b[18:])
		o.MaxWrite = le.Uint32(b[20:])
	}
	if len(b) >= FuseInitOutSize {
		o.TimeGran = le.Uint32(b[24:])
		o.MaxPages = le.Uint16(b[28:])
		o.MapAlignment = le.Uint16(b[30:])
		o.Flags |= uint64(le.Uint32(b[32:])) << 32
		o.RequestTimeout = le.Uint16(b[40:])
	}
	return o, nil
}

// Attr is struct fuse_attr.
type Attr struct {
	Ino, Size, Blocks, Atime, Mtime, Ctime uint64
	Atimensec, Mtimensec, Ctimensec        uint32
	Mode, Nlink, UID, GID, Rdev, Blksize   uint32
	Flags                                  uint32
}

func parseAttr(b []byte) Attr {
	return Attr{
		Ino: le.Uint64(b), Size: le.Uint64(b[8:]), Blocks: le.Uint64(b[16:]),
		Atime: le.Uint64(b[24:]), Mtime: le.Uint64(b[32:]), Ctime: le.Uint64(b[40:]),
		Atimensec: le.Uint32(b[48:]), Mtimensec: le.Uint32(b[52:]), Ctimensec: le.Uint32(b[56:]),
		Mode: le.Uint32(b[60:]), Nlink: le.Uint32(b[64:]), UID: le.Uint32(b[68:]),
		GID: le.Uint32(b[72:]), Rdev: le.Uint32(b[76:]), Blksize: le.Uint32(b[80:]),
		Flags: le.Uint32(b[84:]),
	}
}

// EntryOut is struct fuse_entry_out.
type EntryOut struct {
	NodeID, Generation            uint64
	EntryValid, AttrValid         uint64
	EntryValidNsec, AttrValidNsec uint32
	Attr                          Attr
}

// ParseEntryOut decodes a fuse_entry_out body.
func ParseEntryOut(b []byte) (*EntryOut, error) {
	if len(b) != FuseEntryOutSize {
		return nil, fmt.Errorf("vmm: fuse_entry_out of %d bytes, want %d", len(b), FuseEntryOutSize)
	}
	return &EntryOut{
		NodeID: le.Uint64(b), Generation: le.Uint64(b[8:]),
		EntryValid: le.Uint64(b[16:]), AttrValid: le.Uint64(b[24:]),
		EntryValidNsec: le.Uint32(b[32:]), AttrValidNsec: le.Uint32(b[36:]),
		Attr: parseAttr(b[40:]),
	}, nil
}

// AttrOut is struct fuse_attr_out.
type AttrOut struct {
	AttrValid     uint64
	AttrValidNsec uint32
	Attr          Attr
}

// ParseAttrOut decodes a fuse_attr_out body.
func ParseAttrOut(b []byte) (*AttrOut, error) {
	if len(b) != FuseAttrOutSize {
		return nil, fmt.Errorf("vmm: fuse_attr_out of %d bytes, want %d", len(b), FuseAttrOutSize)
	}
	return &AttrOut{AttrValid: le.Uint64(b), AttrValidNsec: le.Uint32(b[8:]), Attr: parseAttr(b[16:])}, nil
}

// Session speaks FUSE over a Device the way the guest kernel does: unique
// ids step by 2, requests go to one request ring, FORGETs to hiprio.
type Session struct {
	Dev           *Device
	Queue         int // request ring; 1 is the first request queue
	UID, GID, PID uint32
	unique        atomic.Uint64
}

// NewSession returns a session sending requests on ring queue.
func NewSession(d *Device, queue int) *Session {
	return &Session{Dev: d, Queue: queue}
}

// Header returns a fuse_in_header for op on nodeid with the session's next
// unique id and credentials (Len is set by BuildRequest).
func (s *Session) Header(op uint32, nodeid uint64) InHeader {
	return InHeader{Opcode: op, Unique: s.unique.Add(2), NodeID: nodeid, UID: s.UID, GID: s.GID, PID: s.PID}
}

// Call sends one request (args in one segment, data in page segments) with
// room for outArgs bytes of reply arguments (or reply data for READ,
// READDIR, READDIRPLUS), checks the reply header, and returns the body.
// A FUSE error is returned as *FuseError.
func (s *Session) Call(op uint32, nodeid uint64, args, data []byte, outArgs int) ([]byte, error) {
	return s.CallExt(op, nodeid, args, nil, data, outArgs)
}

// CallExt is Call with request extensions (7.38): ext, a whole number of
// 8-byte units (fuse_ext_header and body each), follows args and the
// header's total_extlen counts it. A request with extensions has no data
// pages (the extensions would have to follow them).
func (s *Session) CallExt(op uint32, nodeid uint64, args, ext, data []byte, outArgs int) ([]byte, error) {
	h := s.Header(op, nodeid)
	if len(ext)%8 != 0 || len(ext)/8 > 0xffff || len(ext) > 0 && len(data) > 0 {
		return nil, fmt.Errorf("vmm: request extensions of %d bytes", len(ext))
	}
	h.TotalExtlen = uint16(len(ext) / 8)
	in := BuildRequest(h, len(data), append(append([]byte(nil), args...), ext...))
	reply, err := s.Dev.Do(s.Queue, in, data, FuseOutHeaderSize+outArgs)
	if err != nil {
		return nil, err
	}
	oh, body, err := ParseReply(reply)
	if err != nil {
		return nil, err
	}
	if oh.Unique != h.Unique {
		return nil, fmt.Errorf("vmm: reply unique %d for request %d", oh.Unique, h.Unique)
	}
	if oh.Error > 0 || oh.Error < -4095 {
		return nil, fmt.Errorf("vmm: FUSE opcode %d: invalid error %d in reply", op, oh.Error)
	}
	if oh.Error != 0 {
		if len(body) != 0 {
			return nil, fmt.Errorf("vmm: FUSE opcode %d: error reply with %d body bytes", op, len(body))
		}
		return nil, &FuseError{op, syscall.Errno(-oh.Error)}
	}
	return body, nil
}

// ExtGroups is a FUSE_EXT_GROUPS request extension (type 32) carrying
// groups, padded to 8 bytes.
func ExtGroups(groups ...uint32) []byte {
	n := (8 + 4 + 4*len(groups) + 7) &^ 7
	b := le.AppendUint32(nil, uint32(n))
	b = le.AppendUint32(b, 32)
	b = le.AppendUint32(b, uint32(len(groups)))
	for _, g := range groups {
		b = le.AppendUint32(b, g)
	}
	return append(b, make([]byte, n-len(b))...)
}

// Init sends FUSE_INIT (major 7, the given minor and flags).
func (s *Session) Init(minor uint32, flags uint64) (*InitOut, error) {
	in := InitIn{Major: KernelMajor, Minor: minor, MaxReadahead: 128 * 1024, Flags: flags}
	b, err := s.Call(OpInit, 0, in.Bytes(), nil, FuseInitOutSize)
	if err != nil {
		return nil, err
	}
	return ParseInitOut(b)
}

// Lookup sends LOOKUP of name in parent.
func (s *Session) Lookup(parent uint64, name string) (*EntryOut, error) {
	b, err := s.Call(OpLookup, parent, append([]byte(name), 0), nil, FuseEntryOutSize)
	if err != nil {
		return nil, err
	}
	return ParseEntryOut(b)
}

// Getattr sends GETATTR without a file handle.
func (s *Session) Getattr(nodeid uint64) (*AttrOut, error) {
	b, err := s.Call(OpGetattr, nodeid, make([]byte, 16), nil, FuseAttrOutSize)
	if err != nil {
		return nil, err
	}
	return ParseAttrOut(b)
}

// Forget sends FORGET on the hiprio ring as Linux does: header and
// fuse_forget_in in one 48-byte readable buffer, no writable part. It waits
// for the device to return the chain.
func (s *Session) Forget(nodeid, nlookup uint64) error {
	in := BuildRequest(s.Header(OpForget, nodeid), 0, le.AppendUint64(nil, nlookup))
	_, err := s.Dev.DoRequest(0, FuseRequest{In: in, NoReply: true, Packed: true, Indirect: s.Dev.opts.Indirect})
	return err
}

// Open sends OPEN and returns the file handle.
func (s *Session) Open(nodeid uint64, flags uint32) (uint64, error) {
	b, err := s.Call(OpOpen, nodeid, le.AppendUint32(le.AppendUint32(nil, flags), 0), nil, 16)
	if err != nil {
		return 0, err
	}
	if len(b) != 16 {
		return 0, fmt.Errorf("vmm: fuse_open_out of %d bytes", len(b))
	}
	return le.Uint64(b), nil
}

// ReadWriteIn encodes fuse_read_in / fuse_write_in (same layout): flags
// is read_flags or write_flags (e.g. FUSE_WRITE_KILL_SUIDGID).
func ReadWriteIn(fh, off uint64, size uint32, flags uint32) []byte {
	b := le.AppendUint64(nil, fh)
	b = le.AppendUint64(b, off)
	b = le.AppendUint32(b, size)
	b = le.AppendUint32(b, flags) // read_flags / write_flags
	b = le.AppendUint64(b, 0)     // lock_owner
	b = le.AppendUint32(b, 0)     // flags
	return le.AppendUint32(b, 0)  // padding
}

// Read sends READ of size bytes at off; the data arrives in page segments.
func (s *Session) Read(nodeid, fh, off uint64, size uint32) ([]byte, error) {
	return s.Call(OpRead, nodeid, ReadWriteIn(fh, off, size, 0), nil, int(size))
}

// Write sends WRITE of data at off (data in page segments) and returns the
// count the server reports.
func (s *Session) Write(nodeid, fh, off uint64, data []byte) (uint32, error) {
	b, err := s.Call(OpWrite, nodeid, ReadWriteIn(fh, off, uint32(len(data)), 0), data, 8)
	if err != nil {
		return 0, err
	}
	if len(b) != 8 {
		return 0, fmt.Errorf("vmm: fuse_write_out of %d bytes", len(b))
	}
	return le.Uint32(b), nil
}

// Release sends RELEASE of fh.
func (s *Session) Release(nodeid, fh uint64, flags uint32) error {
	b := le.AppendUint64(nil, fh)
	b = le.AppendUint32(b, flags)
	b = le.AppendUint32(b, 0)
	b = le.AppendUint64(b, 0)
	_, err := s.Call(OpRelease, nodeid, b, nil, 0)
	return err
}

// Destroy sends DESTROY (unmount).
func (s *Session) Destroy() error {
	_, err := s.Call(OpDestroy, 0, nil, nil, 0)
	return err
}
