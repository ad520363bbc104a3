package bufvec

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func tempFile(t testing.TB) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "data"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func fileBytes(t testing.TB, f *os.File) []byte {
	t.Helper()
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// randomSizes returns n segment sizes in [1, maxSize].
func randomSizes(r *rand.Rand, n, maxSize int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = 1 + r.IntN(maxSize)
	}
	return s
}

func TestWriteToReadFrom(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tests := []struct {
		name  string
		sizes []int
		skip  int // cursor position before the I/O
		n     int // -1: everything after the cursor
		off   int64
	}{
		{"one segment", []int{4096}, 0, -1, 0},
		{"few segments", []int{40, 7, 4096, 1, 300}, 0, -1, 0},
		{"cursor mid-segment, partial", []int{40, 7, 4096, 1, 300}, 43, 4000, 12345},
		{"cursor at boundary", []int{40, 7, 4096, 1, 300}, 47, -1, 1 << 32},
		{"nothing", []int{10, 10}, 5, 0, 0},
		{"256 pages", repeat(4096, 256), 0, -1, 4096},
		{"exactly 1024 segments", randomSizes(r, 1024, 64), 0, -1, 0},
		{"1025 segments", randomSizes(r, 1025, 64), 0, -1, 0},
		{"3000 segments", randomSizes(r, 3000, 100), 0, -1, 7},
		{"3000 segments from the middle", randomSizes(r, 3000, 100), 12345, 100000, 99},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, len(tc.sizes), tc.sizes...)
			want, _ := f.flat()
			n := tc.n
			if n < 0 {
				n = len(want) - tc.skip
			}
			want = want[tc.skip : tc.skip+n]
			file := tempFile(t)
			fd := int(file.Fd())

			f.v.Seek(tc.skip)
			w, err := f.v.WriteTo(fd, tc.off, n, Bounded)
			if err != nil || w != n {
				t.Fatalf("WriteTo: %d, %v; want %d", w, err, n)
			}
			if f.v.Pos() != tc.skip+n {
				t.Fatalf("WriteTo left the cursor at %d, want %d", f.v.Pos(), tc.skip+n)
			}
			if n > 0 {
				got := make([]byte, n)
				if _, err := file.ReadAt(got, tc.off); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatal("file holds different bytes than the segments")
				}
			}

			// Scramble the segments, then read the file back into them.
			for i, sp := range f.spans {
				for j := sp[0]; j < sp[1]; j++ {
					f.backing[j] = byte(i + j*7)
				}
			}
			pre, _ := f.flat()
			f.v.Seek(tc.skip)
			rd, err := f.v.ReadFrom(fd, tc.off, n, MayWait)
			if err != nil || rd != n {
				t.Fatalf("ReadFrom: %d, %v; want %d", rd, err, n)
			}
			if f.v.Pos() != tc.skip+n {
				t.Fatalf("ReadFrom left the cursor at %d", f.v.Pos())
			}
			got, _ := f.flat()
			if !bytes.Equal(got[tc.skip:tc.skip+n], want) {
				t.Fatal("ReadFrom filled different bytes than the file holds")
			}
			if !bytes.Equal(got[:tc.skip], pre[:tc.skip]) || !bytes.Equal(got[tc.skip+n:], pre[tc.skip+n:]) {
				t.Fatal("ReadFrom changed bytes outside the requested range")
			}
			f.checkGuards(t)
		})
	}
}

func repeat(n, count int) []int {
	s := make([]int, count)
	for i := range s {
		s[i] = n
	}
	return s
}

func TestReadFromShortAtEOF(t *testing.T) {
	file := tempFile(t)
	content := bytes.Repeat([]byte("0123456789"), 1000) // 10000 bytes
	if _, err := file.Write(content); err != nil {
		t.Fatal(err)
	}
	fd := int(file.Fd())
	tests := []struct {
		name  string
		sizes []int
		off   int64
		want  int
	}{
		{"mid segment", []int{4096, 4096, 4096}, 0, 10000},
		{"at a segment boundary", []int{5000, 5000, 100}, 0, 10000},
		{"from an offset", []int{100, 100, 100}, 9950, 50},
		{"at EOF", []int{100}, 10000, 0},
		{"beyond EOF", []int{100}, 20000, 0},
		{"across the IOV_MAX split", repeat(8, 1500), 0, 10000},
		{"EOF in the second batch", repeat(8, 1500), 2000, 8000},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, len(tc.sizes), tc.sizes...)
			pre, _ := f.flat()
			n, err := f.v.ReadFrom(fd, tc.off, f.v.Size(), Bounded)
			if err != nil || n != tc.want {
				t.Fatalf("ReadFrom: %d, %v; want %d, nil", n, err, tc.want)
			}
			if f.v.Pos() != n {
				t.Fatalf("cursor at %d after reading %d", f.v.Pos(), n)
			}
			got, _ := f.flat()
			if n > 0 && !bytes.Equal(got[:n], content[tc.off:tc.off+int64(n)]) {
				t.Fatal("wrong data")
			}
			if !bytes.Equal(got[n:], pre[n:]) {
				t.Fatal("bytes past EOF were changed")
			}
		})
	}
}

func TestIOStopsAtUnmapped(t *testing.T) {
	tests := []struct {
		name  string
		sizes []int
		skip  int
		want  int
	}{
		{"first segment unmapped", []int{-100, 50}, 0, 0},
		{"after two", []int{30, 20, -100, 50}, 0, 50},
		{"cursor inside, after one", []int{30, 20, -100, 50}, 10, 40},
		{"after 1100 segments", append(repeat(3, 1100), -5, 7), 0, 3300},
		{"beyond the request", []int{30, -10}, 0, 30}, // n stops before it: no error
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, len(tc.sizes), tc.sizes...)
			flat, _ := f.flat()
			n := f.v.Size() - tc.skip
			wantErr := error(ErrUnmapped)
			if tc.name == "beyond the request" {
				n, wantErr = 30, nil
			}
			file := tempFile(t)
			fd := int(file.Fd())

			f.v.Seek(tc.skip)
			w, err := f.v.WriteTo(fd, 0, n, Bounded)
			if w != tc.want || !errors.Is(err, wantErr) || (wantErr == nil && err != nil) {
				t.Fatalf("WriteTo: %d, %v; want %d, %v", w, err, tc.want, wantErr)
			}
			if f.v.Pos() != tc.skip+tc.want {
				t.Fatalf("WriteTo: cursor at %d, want %d", f.v.Pos(), tc.skip+tc.want)
			}
			if got := fileBytes(t, file); !bytes.Equal(got, flat[tc.skip:tc.skip+tc.want]) {
				t.Fatalf("file holds %d bytes, want the %d before the unmapped segment", len(got), tc.want)
			}

			// ReadFrom from a file long enough: same stop.
			if _, err := file.WriteAt(bytes.Repeat([]byte{0x5A}, f.v.Size()), 0); err != nil {
				t.Fatal(err)
			}
			f.v.Seek(tc.skip)
			rd, err := f.v.ReadFrom(fd, 0, n, Bounded)
			if rd != tc.want || !errors.Is(err, wantErr) || (wantErr == nil && err != nil) {
				t.Fatalf("ReadFrom: %d, %v; want %d, %v", rd, err, tc.want, wantErr)
			}
			if f.v.Pos() != tc.skip+tc.want {
				t.Fatalf("ReadFrom: cursor at %d", f.v.Pos())
			}
			got, _ := f.flat()
			if !bytes.Equal(got[tc.skip:tc.skip+tc.want], bytes.Repeat([]byte{0x5A}, tc.want)) {
				t.Fatal("ReadFrom did not fill the mapped bytes")
			}
			if !bytes.Equal(got[tc.skip+tc.want:], flat[tc.skip+tc.want:]) {
				t.Fatal("ReadFrom changed bytes at or after the unmapped segment")
			}
			f.checkGuards(t)
		})
	}
}

func TestIOErrors(t *testing.T) {
	f := newFixture(t, 4, 10, 10)
	file := tempFile(t)
	fd := int(file.Fd())
	for _, n := range []int{21, -1} {
		if w, err := f.v.WriteTo(fd, 0, n, Bounded); !errors.Is(err, ErrShort) || w != 0 || f.v.Pos() != 0 {
			t.Errorf("WriteTo(%d): %d %v", n, w, err)
		}
		if r, err := f.v.ReadFrom(fd, 0, n, Bounded); !errors.Is(err, ErrShort) || r != 0 || f.v.Pos() != 0 {
			t.Errorf("ReadFrom(%d): %d %v", n, r, err)
		}
	}
	// A kernel error is returned as is and consumes nothing.
	if w, err := f.v.WriteTo(-1, 0, 20, Bounded); !errors.Is(err, unix.EBADF) || w != 0 || f.v.Pos() != 0 {
		t.Errorf("WriteTo(bad fd): %d %v", w, err)
	}
	if w, err := f.v.WriteTo(fd, -5, 20, Bounded); !errors.Is(err, unix.EINVAL) || w != 0 {
		t.Errorf("WriteTo(negative offset): %d %v", w, err)
	}
	ro, err := os.Open(file.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if w, err := f.v.WriteTo(int(ro.Fd()), 0, 20, Bounded); !errors.Is(err, unix.EBADF) || w != 0 {
		t.Errorf("WriteTo(read-only fd): %d %v", w, err)
	}
	// The zero Vec (no scratch preallocated) still works.
	var z Vec
	buf := []byte("hello")
	z.Append(Segment{Buf: buf, Len: 5}) // fails: no room
	if w, err := z.WriteTo(fd, 0, 0, Bounded); w != 0 || err != nil {
		t.Errorf("zero Vec WriteTo: %d %v", w, err)
	}
}
