package bufvec

import (
	"os"
	"testing"
)

// benchFile returns a file on tmpfs when /dev/shm exists, else in the test's
// temp directory.
func benchFile(b *testing.B) *os.File {
	dir := "/dev/shm"
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		dir = b.TempDir()
	}
	f, err := os.CreateTemp(dir, "bufvec-bench")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { f.Close(); os.Remove(f.Name()) })
	return f
}

// BenchmarkWriteTo writes 256 separate 4 KiB pages (a 1 MiB FUSE_WRITE) to
// a file with pwritev straight from the segments.
func BenchmarkWriteTo(b *testing.B) {
	const pages, pageSize = 256, 4096
	backing := make([]byte, 2*pages*pageSize)
	v := NewVec(pages)
	for i := range pages {
		at := (pages - 1 - i) * 2 * pageSize // scattered, in reverse order
		if err := v.Append(Segment{Buf: backing[at : at+pageSize], GPA: uint64(at), Len: pageSize}); err != nil {
			b.Fatal(err)
		}
	}
	fd := int(benchFile(b).Fd())
	b.SetBytes(pages * pageSize)
	b.ReportAllocs()
	for b.Loop() {
		v.Rewind()
		if n, err := v.WriteTo(fd, 0, v.Size(), Bounded); err != nil || n != pages*pageSize {
			b.Fatal(n, err)
		}
	}
}

// BenchmarkReadFullHeader reads a 40-byte FUSE in-header that straddles two
// segments.
func BenchmarkReadFullHeader(b *testing.B) {
	seg1, seg2 := make([]byte, 24), make([]byte, 4096)
	v := NewVec(4)
	v.Append(Segment{Buf: seg1, GPA: 0x1000, Len: uint32(len(seg1))})
	v.Append(Segment{Buf: seg2, GPA: 0x8000, Len: uint32(len(seg2))})
	var hdr [40]byte
	b.SetBytes(int64(len(hdr)))
	b.ReportAllocs()
	for b.Loop() {
		v.Rewind()
		if err := v.ReadFull(hdr[:]); err != nil {
			b.Fatal(err)
		}
	}
}
