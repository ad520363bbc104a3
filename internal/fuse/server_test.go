package fuse

import (
	"encoding/binary"
	"io"
	"log/slog"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

func testServer() *Server {
	return NewServer(slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelDebug})))
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

func header(opcode uint32, unique uint64, total int) []byte {
	b := make([]byte, total)
	binary.LittleEndian.PutUint32(b[0:], uint32(total))
	binary.LittleEndian.PutUint32(b[4:], opcode)
	binary.LittleEndian.PutUint64(b[8:], unique)
	return b
}

func TestServeAnswers(t *testing.T) {
	for _, tc := range []struct {
		name      string
		req       []byte
		splits    []int
		outSize   int
		wantLen   uint32
		wantErrno unix.Errno
	}{
		{"init gets ENOSYS", header(OpInit, 7, 104), []int{40}, 80, 16, unix.ENOSYS},
		{"header split across segments", header(OpGetattr, 9, 56), []int{3, 30}, 120, 16, unix.ENOSYS},
		{"unknown opcode", header(4242, 1, 40), nil, 16, 16, unix.ENOSYS},
		{"len disagrees with chain", func() []byte { b := header(OpLookup, 3, 48); b[0] = 99; return b }(), nil, 16, 16, unix.EINVAL},
		{"forget has no reply", header(OpForget, 0, 48), nil, 0, 0, 0},
		{"batch forget has no reply", header(OpBatchForget, 0, 56), nil, 0, 0, 0},
		{"short header", make([]byte, 39), nil, 16, 0, 0},
		{"no room for reply", header(OpInit, 1, 40), nil, 15, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := testServer().Queue(1)
			out := make([]byte, tc.outSize)
			n := q.Serve(vecOf(tc.req, tc.splits...), vecOf(out))
			if n != tc.wantLen {
				t.Fatalf("reply length %d, want %d", n, tc.wantLen)
			}
			if n == 0 {
				return
			}
			if got := binary.LittleEndian.Uint32(out[0:]); got != n {
				t.Errorf("out.len %d, want %d", got, n)
			}
			if got := unix.Errno(-int32(binary.LittleEndian.Uint32(out[4:]))); got != tc.wantErrno {
				t.Errorf("error %v, want %v", got, tc.wantErrno)
			}
			if got, want := binary.LittleEndian.Uint64(out[8:]), binary.LittleEndian.Uint64(tc.req[8:]); got != want {
				t.Errorf("unique %d, want %d", got, want)
			}
		})
	}
}

// FuzzServe feeds arbitrary readable bytes, split at fuzz-chosen points, and
// an arbitrary writable size through the server: it must never panic and
// never claim more reply bytes than the writable side holds.
func FuzzServe(f *testing.F) {
	f.Add(header(OpInit, 2, 104), uint16(80), uint8(40))
	f.Add(header(OpForget, 0, 48), uint16(0), uint8(0))
	f.Add([]byte{1, 2, 3}, uint16(16), uint8(1))
	f.Fuzz(func(t *testing.T, req []byte, outSize uint16, split uint8) {
		q := testServer().Queue(1)
		out := make([]byte, outSize)
		n := q.Serve(vecOf(req, int(split)), vecOf(out))
		if int(n) > len(out) {
			t.Fatalf("reply of %d bytes in %d writable", n, len(out))
		}
		if n != 0 && binary.LittleEndian.Uint32(out) != n {
			t.Fatalf("out.len %d but used length %d", binary.LittleEndian.Uint32(out), n)
		}
	})
}

func BenchmarkServeENOSYS(b *testing.B) {
	q := NewServer(slog.New(slog.NewTextHandler(io.Discard, nil))).Queue(1)
	req := header(OpGetattr, 5, 56)
	out := make([]byte, 120)
	in, ov := vecOf(req, 40), vecOf(out)
	b.ReportAllocs()
	for b.Loop() {
		in.Rewind()
		ov.Rewind()
		q.Serve(in, ov)
	}
}
