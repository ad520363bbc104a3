package fuse

import (
	"encoding/binary"
	"io"
	"log/slog"
	"testing"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

func debugLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// vecOf splits b into segments of the given sizes (the rest in one more).
func vecOf(b []byte, sizes ...int) *bufvec.Vec {
	v := bufvec.NewVec(len(sizes) + 1)
	for _, n := range sizes {
		n = min(n, len(b))
		if err := v.Append(bufvec.Segment{Buf: b[:n], Len: uint32(n)}); err != nil {
			panic(err)
		}
		b = b[n:]
	}
	if len(b) > 0 {
		if err := v.Append(bufvec.Segment{Buf: b, Len: uint32(len(b))}); err != nil {
			panic(err)
		}
	}
	return v
}

// chunked splits b into segments of k bytes.
func chunked(b []byte, k int) *bufvec.Vec {
	sizes := make([]int, 0, len(b)/k+1)
	for n := len(b); n > 0; n -= k {
		sizes = append(sizes, min(k, n))
	}
	return vecOf(b, sizes...)
}

// header returns a request of total bytes with a fuse_in_header for opcode.
func header(opcode uint32, unique uint64, total int) []byte {
	b := make([]byte, total)
	binary.LittleEndian.PutUint32(b[0:], uint32(total))
	binary.LittleEndian.PutUint32(b[4:], opcode)
	binary.LittleEndian.PutUint64(b[8:], unique)
	return b
}

// Caller identity used in requests built by mkreq.
const (
	testNode = 5
	testUID  = 1000
	testGID  = 100
	testPID  = 77
)

// mkreq builds a request: header, fixed argument bytes, then each name
// followed by a NUL, then raw (not NUL-terminated) bytes.
func mkreq(op uint32, unique uint64, args []byte, names []string, raw []byte) []byte {
	b := make([]byte, InHeaderSize, 256)
	b = append(b, args...)
	for _, n := range names {
		b = append(b, n...)
		b = append(b, 0)
	}
	b = append(b, raw...)
	binary.LittleEndian.PutUint32(b[0:], uint32(len(b)))
	binary.LittleEndian.PutUint32(b[4:], op)
	binary.LittleEndian.PutUint64(b[8:], unique)
	binary.LittleEndian.PutUint64(b[16:], testNode)
	binary.LittleEndian.PutUint32(b[24:], testUID)
	binary.LittleEndian.PutUint32(b[28:], testGID)
	binary.LittleEndian.PutUint32(b[32:], testPID)
	return b
}

// hdrOf decodes the fuse_in_header of req by hand (kernel offsets).
func hdrOf(req []byte) gofuse.InHeader {
	return gofuse.InHeader{
		Length: binary.LittleEndian.Uint32(req[0:]),
		Opcode: binary.LittleEndian.Uint32(req[4:]),
		Unique: binary.LittleEndian.Uint64(req[8:]),
		NodeId: binary.LittleEndian.Uint64(req[16:]),
		Caller: gofuse.Caller{
			Owner: gofuse.Owner{Uid: binary.LittleEndian.Uint32(req[24:]), Gid: binary.LittleEndian.Uint32(req[28:])},
			Pid:   binary.LittleEndian.Uint32(req[32:]),
		},
		TotalExtlen: binary.LittleEndian.Uint16(req[36:]),
	}
}

// argBytes returns the size argument bytes of an In struct (after its
// InHeader).
func argBytes[T any](v T, size int) []byte {
	b := unsafe.Slice((*byte)(unsafe.Pointer(&v)), unsafe.Sizeof(v))
	return append([]byte(nil), b[InHeaderSize:InHeaderSize+size]...)
}

// withHdr returns v (an In struct) with its InHeader set to h.
func withHdr[T any](v T, h gofuse.InHeader) T {
	*(*gofuse.InHeader)(unsafe.Pointer(&v)) = h
	return v
}

// outBytes returns the first size bytes of a reply struct.
func outBytes[T any](v T, size int) []byte {
	b := unsafe.Slice((*byte)(unsafe.Pointer(&v)), unsafe.Sizeof(v))
	return append([]byte(nil), b[:size]...)
}

// replyBytes is the exact reply expected for unique with payload.
func replyBytes(unique uint64, errno int32, payload []byte) []byte {
	b := make([]byte, OutHeaderSize, OutHeaderSize+len(payload))
	binary.LittleEndian.PutUint32(b[0:], uint32(OutHeaderSize+len(payload)))
	binary.LittleEndian.PutUint32(b[4:], uint32(errno))
	binary.LittleEndian.PutUint64(b[8:], unique)
	return append(b, payload...)
}

// kernelInitFlags is what a Linux 6.1 guest with a DAX window offers in
// flags: what 6.12 offers without one (linuxInitFlags), and MAP_ALIGNMENT
// (flags2 = SECURITY_CTX... are in kernelInitFlags2).
const kernelInitFlags = uint32(linuxInitFlags&flagsBits | gofuse.CAP_MAP_ALIGNMENT)

const kernelInitFlags2 = uint32((gofuse.CAP_SECURITY_CTX | gofuse.CAP_HAS_INODE_DAX | gofuse.CAP_CREATE_SUPP_GROUP |
	gofuse.CAP_HAS_EXPIRE_ONLY | gofuse.CAP_DIRECT_IO_ALLOW_MMAP) >> 32)

// initReq builds an INIT request; argSize is 16 (before 7.36) or 64.
func initReq(unique uint64, major, minor, flags, flags2 uint32, argSize int) []byte {
	a := make([]byte, argSize)
	binary.LittleEndian.PutUint32(a[0:], major)
	binary.LittleEndian.PutUint32(a[4:], minor)
	binary.LittleEndian.PutUint32(a[8:], 128<<10) // max_readahead
	binary.LittleEndian.PutUint32(a[12:], flags)
	if argSize >= 20 {
		binary.LittleEndian.PutUint32(a[16:], flags2)
	}
	return mkreq(OpInit, unique, a, nil, nil)
}

// serve runs one request through q: in split by inK-byte segments (0: one
// segment), reply room outSize split by outK-byte segments. It returns the
// reply bytes (the first n of the writable buffer).
func serve(t testing.TB, q *Queue, req []byte, inK, outSize, outK int) []byte {
	t.Helper()
	out := make([]byte, outSize+64)
	for i := range out {
		out[i] = 0xa5
	}
	in := vecOf(req)
	if inK > 0 {
		in = chunked(req, inK)
	}
	ov := vecOf(out[:outSize])
	if outK > 0 {
		ov = chunked(out[:outSize], outK)
	}
	n := q.Serve(in, ov)
	if int(n) > outSize {
		t.Fatalf("reply of %d bytes in %d writable", n, outSize)
	}
	for i := outSize; i < len(out); i++ {
		if out[i] != 0xa5 {
			t.Fatalf("byte %d written past the %d writable bytes", i, outSize)
		}
	}
	if n != 0 {
		if got := binary.LittleEndian.Uint32(out); got != n {
			t.Fatalf("out.len %d but used length %d", got, n)
		}
	}
	return out[:n]
}

// newSession returns a server with an initialised session (a Linux 6.1
// client) and a queue, with the fake file system's call log cleared.
func newSession(t testing.TB, fs *fakeFS) (*Server, *Queue) {
	t.Helper()
	s := NewServer(fs, ServerOptions{}, debugLogger())
	q := s.Queue(1)
	r := serve(t, q, initReq(1, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)
	if len(r) != 80 || binary.LittleEndian.Uint32(r[4:]) != 0 {
		t.Fatalf("INIT failed: % x", r)
	}
	fs.mu.Lock()
	fs.calls = nil
	fs.mu.Unlock()
	return s, q
}

func errnoOf(r []byte) int32 {
	if len(r) < OutHeaderSize {
		return 1 // no reply
	}
	return int32(binary.LittleEndian.Uint32(r[4:]))
}
