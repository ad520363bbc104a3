package fuse

import (
	"encoding/binary"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// benchFS answers READ, WRITE and GETATTR without doing I/O, so the
// benchmarks measure the server alone.
type benchFS struct{ fakeFS }

func (*benchFS) Read(in *gofuse.ReadIn, dst *bufvec.Vec) (int, syscall.Errno) {
	n := min(int(in.Size), dst.Len())
	if dst.Skip(n) != nil {
		return 0, syscall.EFAULT
	}
	return n, 0
}

func (*benchFS) Write(in *gofuse.WriteIn, src *bufvec.Vec) (int, syscall.Errno) {
	if src.Skip(int(in.Size)) != nil {
		return 0, syscall.EFAULT
	}
	return int(in.Size), 0
}

func (*benchFS) GetAttr(in *gofuse.GetAttrIn, out *gofuse.AttrOut) syscall.Errno {
	out.Ino = in.NodeId
	out.Mode = syscall.S_IFREG | 0o644
	out.Nlink = 1
	return 0
}

// pages returns a Vec of a head segment of headLen bytes followed by n
// 4 KiB pages, as a Linux guest lays out READ and WRITE.
func pages(head []byte, n int) *bufvec.Vec {
	v := bufvec.NewVec(n + 1)
	_ = v.Append(bufvec.Segment{Buf: head, Len: uint32(len(head))})
	for range n {
		_ = v.Append(bufvec.Segment{Buf: make([]byte, 4096), Len: 4096})
	}
	return v
}

type benchCase struct {
	in, out *bufvec.Vec
	want    uint32
}

func benchCases(tb testing.TB, opts ServerOptions) (*Queue, map[string]benchCase) {
	fs := &benchFS{}
	s := NewServer(fs, opts, quietLogger())
	q := s.Queue(1)
	if r := serve(tb, q, initReq(1, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0); errnoOf(r) != 0 {
		tb.Fatalf("INIT: % x", r)
	}
	read := func(size int) benchCase {
		req := mkreq(OpRead, 2, argBytes(gofuse.ReadIn{Fh: 1, Size: uint32(size)}, 40), nil, nil)
		return benchCase{vecOf(req), pages(make([]byte, 16), size/4096), uint32(16 + size)}
	}
	write := func(size int) benchCase {
		req := mkreq(OpWrite, 3, argBytes(gofuse.WriteIn{Fh: 1, Size: uint32(size)}, 40), nil, nil)
		binary.LittleEndian.PutUint32(req, uint32(len(req)+size))
		return benchCase{pages(req, size/4096), vecOf(make([]byte, 24), 16), 24}
	}
	return q, map[string]benchCase{
		"READ-4KiB":  read(4096),
		"READ-1MiB":  read(1 << 20),
		"WRITE-4KiB": write(4096),
		"WRITE-1MiB": write(1 << 20),
		"GETATTR":    {vecOf(mkreq(OpGetattr, 4, make([]byte, 16), nil, nil)), vecOf(make([]byte, 16+attrOutSize)), 16 + attrOutSize},
	}
}

func (c benchCase) run(tb testing.TB, q *Queue) {
	c.in.Rewind()
	c.out.Rewind()
	if n := q.Serve(c.in, c.out); n != c.want {
		tb.Fatalf("reply of %d bytes, want %d", n, c.want)
	}
}

func BenchmarkServe(b *testing.B) {
	for _, metrics := range []bool{false, true} {
		q, cases := benchCases(b, ServerOptions{Metrics: metrics})
		for _, name := range []string{"READ-4KiB", "READ-1MiB", "WRITE-4KiB", "WRITE-1MiB", "GETATTR"} {
			c := cases[name]
			if metrics {
				name += "-metrics"
			}
			b.Run(name, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					c.run(b, q)
				}
			})
		}
	}
}

// The hot path allocates nothing (with debug logging off), with metrics on
// or off.
func TestZeroAllocs(t *testing.T) {
	for _, metrics := range []bool{false, true} {
		q, cases := benchCases(t, ServerOptions{Metrics: metrics})
		for name, c := range cases {
			if a := testing.AllocsPerRun(100, func() { c.run(t, q) }); a != 0 {
				t.Errorf("%s (metrics %v): %v allocations per request", name, metrics, a)
			}
		}
	}
}
