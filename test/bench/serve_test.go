package bench

import (
	"encoding/binary"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
	"github.com/govirtiofsd/govirtiofsd/internal/fuse"
)

// BenchmarkServeMeta runs the metadata cycle of the meta workload (CREATE,
// GETATTR, RELEASE, UNLINK, FORGET: one op) through the FUSE server and the
// passthrough file system on a tmpfs share, with no rings and no threads in
// between: the daemon's own cost of a metadata request, counted in a fixed
// number of operations (-benchtime 20000x), which an instruction count
// (callgrind) compares between two builds whatever the machine's load.
func BenchmarkServeMeta(b *testing.B) {
	fsys, log := benchFileSystem(b, &SuiteOptions{Dir: b.TempDir(), FileSize: 1 << 20})
	q := fuse.NewServer(fsys, fuse.ServerOptions{}, log).Queue(1)
	c := &serveClient{q: q, in: bufvec.NewVec(1), out: bufvec.NewVec(1), reply: make([]byte, 4096)}
	init := make([]byte, 64)
	binary.LittleEndian.PutUint32(init[0:], fuse.KernelVersion)
	binary.LittleEndian.PutUint32(init[4:], fuse.KernelMinor)
	if errno := c.call(b, fuse.OpInit, 0, init, ""); errno != 0 {
		b.Fatalf("INIT: errno %d", errno)
	}
	create := make([]byte, 16)                           // fuse_create_in: flags, mode, umask, open_flags
	binary.LittleEndian.PutUint32(create[0:], 0o2|0o100) // O_RDWR|O_CREAT
	binary.LittleEndian.PutUint32(create[4:], 0o100644)
	getattr := make([]byte, 16)
	release := make([]byte, 24)
	forget := make([]byte, 8)
	binary.LittleEndian.PutUint64(forget, 1)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if errno := c.call(b, fuse.OpCreate, 1, create, "f"); errno != 0 {
			b.Fatalf("CREATE: errno %d", errno)
		}
		node := binary.LittleEndian.Uint64(c.reply[fuse.OutHeaderSize:])
		fh := binary.LittleEndian.Uint64(c.reply[fuse.OutHeaderSize+128:])
		if errno := c.call(b, fuse.OpGetattr, node, getattr, ""); errno != 0 {
			b.Fatalf("GETATTR: errno %d", errno)
		}
		binary.LittleEndian.PutUint64(release[0:], fh)
		if errno := c.call(b, fuse.OpRelease, node, release, ""); errno != 0 {
			b.Fatalf("RELEASE: errno %d", errno)
		}
		if errno := c.call(b, fuse.OpUnlink, 1, nil, "f"); errno != 0 {
			b.Fatalf("UNLINK: errno %d", errno)
		}
		c.call(b, fuse.OpForget, node, forget, "")
	}
}

// serveClient hands requests to one fuse.Queue as a ring would.
type serveClient struct {
	q       *fuse.Queue
	in, out *bufvec.Vec
	req     [256]byte
	reply   []byte
	unique  uint64
}

// call serves opcode op on node with the fixed arguments args and, unless
// empty, a NUL-terminated name; it returns the reply's errno (positive).
func (c *serveClient) call(b *testing.B, op uint32, node uint64, args []byte, name string) int32 {
	c.unique++
	n := fuse.InHeaderSize + copy(c.req[fuse.InHeaderSize:], args)
	if name != "" {
		n += copy(c.req[n:], name)
		c.req[n] = 0
		n++
	}
	binary.LittleEndian.PutUint32(c.req[0:], uint32(n))
	binary.LittleEndian.PutUint32(c.req[4:], op)
	binary.LittleEndian.PutUint64(c.req[8:], c.unique)
	binary.LittleEndian.PutUint64(c.req[16:], node)
	c.in.Reset()
	c.out.Reset()
	if c.in.Append(bufvec.Segment{Buf: c.req[:n], Len: uint32(n)}) != nil ||
		c.out.Append(bufvec.Segment{Buf: c.reply, Len: uint32(len(c.reply))}) != nil {
		b.Fatal("append segment")
	}
	if c.q.Serve(c.in, c.out) == 0 {
		return 0 // FORGET
	}
	return -int32(binary.LittleEndian.Uint32(c.reply[4:]))
}
