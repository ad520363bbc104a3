package bufvec

import (
	"bytes"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// FuzzCursor builds a Vec from fuzz-chosen segment sizes (some unmapped)
// and runs a fuzz-chosen sequence of cursor operations against a model: a
// flat []byte with a per-byte "mapped" flag and a position.
//
// Input: byte 0 = number of segments (mod 17); then per segment one size
// byte (bit 7: unmapped, bits 0-6: length 0..127); the rest is a program of
// operations, each an opcode byte followed by argument bytes.
func FuzzCursor(f *testing.F) {
	f.Add([]byte{3, 4, 0x83, 5, 1, 3, 2, 6, 4, 9})
	f.Add([]byte{4, 40, 16, 0x90, 100, 0, 30, 1, 10, 3, 50, 2, 5, 5, 20, 7, 2, 1, 8, 0, 60})
	f.Add([]byte{2, 127, 127, 9, 0, 200, 10, 100, 50, 6, 0, 3})
	f.Add([]byte{16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0x8e, 15, 16, 0, 7, 0, 200, 9, 10, 250, 10, 0, 255, 4, 1, 5, 3})
	f.Add([]byte{1, 0x80, 4, 0, 0, 1})

	file, err := os.CreateTemp(f.TempDir(), "fuzz")
	if err != nil {
		f.Fatal(err)
	}
	defer file.Close()
	fd := int(file.Fd())

	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		nseg := int(data[0]) % 17
		data = data[1:]
		if len(data) < nseg {
			return
		}
		var sizes []int
		for _, b := range data[:nseg] {
			n := int(b & 0x7f)
			if b&0x80 != 0 {
				n = -n
			}
			sizes = append(sizes, n)
		}
		prog := data[nseg:]
		fx := newFixture(t, 17, sizes...)
		v := fx.v
		model, mapped := fx.flat()
		pos := 0

		// next returns the next program byte (0 when the program is over).
		next := func() int {
			if len(prog) == 0 {
				return 0
			}
			b := prog[0]
			prog = prog[1:]
			return int(b)
		}
		// length returns a length that is usually in range, sometimes
		// past the end and sometimes negative.
		length := func() int {
			b := next()
			switch {
			case b == 255:
				return -1 - next()
			case b >= 200:
				return len(model) - pos + (b - 200)
			}
			return b % (len(model) + 2)
		}
		// position reads an absolute position: -1, or up to two past
		// the end.
		position := func() int {
			if b := next(); b != 255 {
				return b % (len(model) + 3)
			}
			return -1
		}
		// expect is the model's verdict for a copy of n bytes at pos.
		expect := func(at, n int) error {
			if n < 0 || at < 0 || at+n > len(model) {
				return ErrShort
			}
			for _, m := range mapped[at : at+n] {
				if !m {
					return ErrUnmapped
				}
			}
			return nil
		}
		// mappedRun is how many bytes from at on are mapped (at most n).
		mappedRun := func(at, n int) int {
			k := 0
			for k < n && mapped[at+k] {
				k++
			}
			return k
		}
		pattern := func(n, seed int) []byte {
			p := make([]byte, max(n, 0))
			for i := range p {
				p[i] = byte(seed + i*13)
			}
			return p
		}
		same := func(op string, got, want error) {
			t.Helper()
			if !errors.Is(got, want) || (want == nil && got != nil) {
				t.Fatalf("%s at %d: %v, model says %v", op, pos, got, want)
			}
		}
		// refused reports whether a transfer of n bytes at the cursor
		// asked for more than there is, and then that it was refused
		// with ErrShort, having moved nothing.
		refused := func(op string, n, moved int, err error) bool {
			t.Helper()
			if n >= 0 && pos+n <= len(model) {
				return false
			}
			if moved != 0 || !errors.Is(err, ErrShort) {
				t.Fatalf("%s(%d) at %d: %d %v, want ErrShort", op, n, pos, moved, err)
			}
			return true
		}

		for steps := 0; len(prog) > 0 && steps < 200; steps++ {
			switch op := next() % 12; op {
			case 0: // ReadFull
				n := length()
				p := make([]byte, max(n, 0))
				want := expect(pos, n)
				if n < 0 {
					break // len(p) cannot be negative
				}
				err := v.ReadFull(p)
				same("ReadFull", err, want)
				if err == nil {
					if !bytes.Equal(p, model[pos:pos+n]) {
						t.Fatalf("ReadFull(%d) at %d: %x, model %x", n, pos, p, model[pos:pos+n])
					}
					pos += n
				} else if !bytes.Equal(p, make([]byte, n)) {
					t.Fatalf("failed ReadFull wrote into the buffer")
				}
			case 1: // WriteFull
				n := length()
				if n < 0 {
					break
				}
				p := pattern(n, next())
				err := v.WriteFull(p)
				same("WriteFull", err, expect(pos, n))
				if err == nil {
					copy(model[pos:], p)
					pos += n
				}
			case 2: // Skip
				n := length()
				err := v.Skip(n)
				want := error(nil)
				if n < 0 || pos+n > len(model) {
					want = ErrShort
				}
				same("Skip", err, want)
				if err == nil {
					pos += n
				}
			case 3: // Seek
				to := position()
				err := v.Seek(to)
				want := error(nil)
				if to < 0 || to > len(model) {
					want = ErrShort
				}
				same("Seek", err, want)
				if err == nil {
					pos = to
				}
			case 4: // WriteAt
				at := position()
				n := next() % (len(model) + 2)
				p := pattern(n, next())
				err := v.WriteAt(p, at)
				same("WriteAt", err, expect(at, n))
				if err == nil {
					copy(model[at:], p)
				}
			case 5: // Zero
				n := length()
				err := v.Zero(n)
				same("Zero", err, expect(pos, n))
				if err == nil {
					clear(model[pos : pos+n])
					pos += n
				}
			case 6: // Contiguous
				n := length()
				b, ok := v.Contiguous(n)
				// The model: ok iff n == 0, or the n bytes lie in one
				// mapped segment.
				want := n == 0
				if n > 0 && pos+n <= len(model) {
					want = segmentOf(fx, pos) == segmentOf(fx, pos+n-1) && mapped[pos]
				}
				if ok != want {
					t.Fatalf("Contiguous(%d) at %d: %v, model says %v", n, pos, ok, want)
				}
				if ok {
					if len(b) != n || !bytes.Equal(b, model[pos:pos+n]) {
						t.Fatalf("Contiguous(%d) at %d returned %x, model %x", n, pos, b, model[pos:pos+n])
					}
					if n > 0 {
						// Write through it: it aliases the segment.
						b[0] = byte(next())
						model[pos] = b[0]
					}
				}
			case 7: // Rewind
				v.Rewind()
				pos = 0
			case 8: // Unmapped
				n := length()
				got := v.Unmapped(n)
				want := false
				if n > 0 {
					want = mappedRun(pos, min(n, len(model)-pos)) < min(n, len(model)-pos)
				}
				if got != want {
					t.Fatalf("Unmapped(%d) at %d: %v, model says %v", n, pos, got, want)
				}
			case 9: // WriteTo the file
				n := length()
				off := int64(next())
				err := unix.Ftruncate(fd, 0)
				if err != nil {
					t.Fatal(err)
				}
				wait := Wait(n%2 == 0) // both syscall modes
				w, err := v.WriteTo(fd, off, n, wait)
				if refused("WriteTo", n, w, err) {
					break
				}
				k := mappedRun(pos, n)
				want := error(nil)
				if k < n {
					want = ErrUnmapped
				}
				if w != k {
					t.Fatalf("WriteTo(%d) at %d wrote %d, model says %d", n, pos, w, k)
				}
				same("WriteTo", err, want)
				got := make([]byte, k)
				if r, err := unix.Pread(fd, got, off); r != k || (err != nil && k > 0) {
					t.Fatalf("file holds %d bytes at %d (%v), want %d", r, off, err, k)
				}
				if !bytes.Equal(got, model[pos:pos+k]) {
					t.Fatalf("WriteTo wrote %x, model %x", got, model[pos:pos+k])
				}
				pos += k
			case 10: // ReadFrom a file of a fuzz-chosen size
				n := length()
				size := next()
				off := int64(next() % 64)
				content := pattern(size, next())
				if err := unix.Ftruncate(fd, 0); err != nil {
					t.Fatal(err)
				}
				if _, err := unix.Pwrite(fd, content, 0); err != nil {
					t.Fatal(err)
				}
				wait := Wait(n%2 == 0) // both syscall modes
				r, err := v.ReadFrom(fd, off, n, wait)
				if refused("ReadFrom", n, r, err) {
					break
				}
				avail := max(size-int(off), 0)
				k := mappedRun(pos, n)
				want := error(nil)
				switch {
				case avail < k:
					k = avail // end of file first
				case k < n:
					want = ErrUnmapped
				}
				if r != k {
					t.Fatalf("ReadFrom(%d) at %d from a file of %d at %d: read %d, model says %d", n, pos, size, off, r, k)
				}
				same("ReadFrom", err, want)
				if k > 0 {
					copy(model[pos:], content[off:off+int64(k)])
				}
				pos += k
			case 11: // Append one more segment, while there is room
				sz := next()
				seg := Segment{GPA: 0xF0000, Len: uint32(sz & 0x3f)}
				if sz&0x80 == 0 {
					seg.Buf = make([]byte, sz&0x3f)
					for i := range seg.Buf {
						seg.Buf[i] = byte(sz + i)
					}
				}
				full := len(v.Segments()) == v.Cap()
				err := v.Append(seg)
				if full && seg.Len > 0 {
					if err == nil {
						t.Fatal("Append beyond the capacity succeeded")
					}
					break
				}
				if err != nil {
					t.Fatalf("Append: %v", err)
				}
				if seg.Len > 0 {
					fx.extra(seg)
					if seg.Buf != nil {
						model = append(model, seg.Buf...)
					} else {
						model = append(model, make([]byte, seg.Len)...)
					}
					for range seg.Len {
						mapped = append(mapped, seg.Buf != nil)
					}
				}
			}
			if v.Pos() != pos || v.Len() != len(model)-pos || v.Size() != len(model) {
				t.Fatalf("step %d: Pos %d Len %d Size %d, model pos %d size %d", steps, v.Pos(), v.Len(), v.Size(), pos, len(model))
			}
			fx.checkGuards(t)
			got := fx.contents()
			for i := range model {
				if mapped[i] && got[i] != model[i] {
					t.Fatalf("step %d: byte %d is %#x, model %#x", steps, i, got[i], model[i])
				}
			}
		}
	})
}

// segmentOf returns the index of the segment holding byte pos, from the
// fixture's own record of the segments.
func segmentOf(f *fixture, pos int) int {
	var lens []int
	for _, sp := range f.spans {
		lens = append(lens, sp[1]-sp[0])
	}
	for _, s := range f.extras {
		lens = append(lens, int(s.Len))
	}
	for i, n := range lens {
		if pos < n {
			return i
		}
		pos -= n
	}
	return -1
}

// extra records a segment appended outside the fixture's backing array.
func (f *fixture) extra(s Segment) { f.extras = append(f.extras, s) }

// contents returns the current bytes of all segments in order (zeros for
// unmapped ones), read through the fixture, not through the Vec.
func (f *fixture) contents() []byte {
	b, _ := f.flat()
	for _, s := range f.extras {
		if s.Buf != nil {
			b = append(b, s.Buf...)
		} else {
			b = append(b, make([]byte, s.Len)...)
		}
	}
	return b
}
