package bufvec

import (
	"bytes"
	"errors"
	"testing"
)

// guard is the byte pattern filling the gaps between segment buffers; a
// copy that strays outside a segment changes it.
const guard = 0xA5

// fixture is a Vec built over one backing array, with guard gaps between
// the segments, and the flat model of its bytes.
type fixture struct {
	v       *Vec
	backing []byte
	// spans[i] is segment i's [start, end) in backing; mapped[i] whether
	// the segment is mapped.
	spans  [][2]int
	mapped []bool
	// extras are segments appended later, outside backing.
	extras []Segment
}

// newFixture builds a Vec from segment sizes; negative sizes are unmapped
// segments of -size bytes. Mapped bytes are filled with a counting pattern.
func newFixture(t testing.TB, capSegs int, sizes ...int) *fixture {
	t.Helper()
	const gap = 8
	total := gap
	for _, s := range sizes {
		total += abs(s) + gap
	}
	f := &fixture{v: NewVec(capSegs), backing: bytes.Repeat([]byte{guard}, total)}
	at := gap
	gpa := uint64(0x10000)
	for i, s := range sizes {
		n := abs(s)
		seg := Segment{GPA: gpa, Len: uint32(n)}
		if s >= 0 {
			seg.Buf = f.backing[at : at+n : at+n]
			for j := range seg.Buf {
				seg.Buf[j] = byte(i*31 + j + 1)
			}
		}
		if err := f.v.Append(seg); err != nil {
			t.Fatalf("Append segment %d: %v", i, err)
		}
		if n > 0 {
			f.spans = append(f.spans, [2]int{at, at + n})
			f.mapped = append(f.mapped, s >= 0)
		}
		at += n + gap
		gpa += uint64(n) + 0x1000
	}
	return f
}

func abs(n int) int {
	if n < 0 {
		return -n
	}
	return n
}

// flat returns the Vec's bytes in order (zeros for unmapped segments) and,
// per byte, whether it is mapped.
func (f *fixture) flat() ([]byte, []bool) {
	var b []byte
	var m []bool
	for i, sp := range f.spans {
		n := sp[1] - sp[0]
		if f.mapped[i] {
			b = append(b, f.backing[sp[0]:sp[1]]...)
		} else {
			b = append(b, make([]byte, n)...)
		}
		for range n {
			m = append(m, f.mapped[i])
		}
	}
	return b, m
}

// checkGuards fails if any byte outside the mapped segments changed.
func (f *fixture) checkGuards(t testing.TB) {
	t.Helper()
	in := make([]bool, len(f.backing))
	for i, sp := range f.spans {
		if f.mapped[i] {
			for j := sp[0]; j < sp[1]; j++ {
				in[j] = true
			}
		}
	}
	for i, b := range f.backing {
		if !in[i] && b != guard {
			t.Fatalf("byte %d outside every segment was overwritten (%#x)", i, b)
		}
	}
}

func TestAppend(t *testing.T) {
	v := NewVec(3)
	if v.Cap() != 3 || v.Size() != 0 || v.Len() != 0 || v.Pos() != 0 {
		t.Fatalf("fresh Vec: cap %d size %d len %d pos %d", v.Cap(), v.Size(), v.Len(), v.Pos())
	}
	buf := make([]byte, 10)
	tests := []struct {
		name    string
		seg     Segment
		wantErr bool
		segs    int
		size    int
	}{
		{"mapped", Segment{Buf: buf[:4], GPA: 0x1000, Len: 4}, false, 1, 4},
		{"zero length is dropped", Segment{GPA: 0x2000}, false, 1, 4},
		{"zero length mapped is dropped", Segment{Buf: buf[:0], GPA: 0x2000}, false, 1, 4},
		{"len mismatch", Segment{Buf: buf[:4], GPA: 0x3000, Len: 5}, true, 1, 4},
		{"unmapped", Segment{GPA: 0x4000, Len: 100}, false, 2, 104},
		{"mapped 2", Segment{Buf: buf[4:10], GPA: 0x5000, Len: 6}, false, 3, 110},
		{"full", Segment{Buf: buf[:1], GPA: 0x6000, Len: 1}, true, 3, 110},
		{"zero length into a full Vec", Segment{GPA: 0x7000}, false, 3, 110},
	}
	for _, tc := range tests {
		err := v.Append(tc.seg)
		if (err != nil) != tc.wantErr {
			t.Errorf("%s: err %v, want error %v", tc.name, err, tc.wantErr)
		}
		if len(v.Segments()) != tc.segs || v.Size() != tc.size || v.Len() != tc.size {
			t.Errorf("%s: %d segments, size %d, len %d; want %d, %d", tc.name, len(v.Segments()), v.Size(), v.Len(), tc.segs, tc.size)
		}
	}
	if !v.Segments()[0].Mapped() || v.Segments()[1].Mapped() {
		t.Errorf("Mapped() wrong: %v %v", v.Segments()[0].Mapped(), v.Segments()[1].Mapped())
	}
	v.Reset()
	if len(v.Segments()) != 0 || v.Size() != 0 || v.Cap() != 3 {
		t.Errorf("after Reset: %d segments, size %d, cap %d", len(v.Segments()), v.Size(), v.Cap())
	}
	// The zero Vec has no room.
	var z Vec
	if err := z.Append(Segment{Buf: buf, Len: uint32(len(buf))}); err == nil {
		t.Error("zero Vec accepted a segment")
	}
}

func TestReadFullAcrossSegments(t *testing.T) {
	f := newFixture(t, 8, 3, 1, 5, 7)
	want, _ := f.flat()
	for _, chunk := range []int{1, 2, 3, 4, 5, 16} {
		f.v.Rewind()
		var got []byte
		for f.v.Len() > 0 {
			p := make([]byte, min(chunk, f.v.Len()))
			before := f.v.Pos()
			if err := f.v.ReadFull(p); err != nil {
				t.Fatalf("chunk %d at %d: %v", chunk, before, err)
			}
			if f.v.Pos() != before+len(p) || f.v.Len() != f.v.Size()-f.v.Pos() {
				t.Fatalf("chunk %d: pos %d len %d after reading %d at %d", chunk, f.v.Pos(), f.v.Len(), len(p), before)
			}
			got = append(got, p...)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("chunk %d: read %x, want %x", chunk, got, want)
		}
		// Reading past the end fails and consumes nothing.
		if err := f.v.ReadFull(make([]byte, 1)); !errors.Is(err, ErrShort) {
			t.Fatalf("read at end: %v", err)
		}
		if err := f.v.ReadFull(nil); err != nil {
			t.Fatalf("empty read at end: %v", err)
		}
	}
	// A read longer than what is left consumes nothing.
	f.v.Rewind()
	f.v.Skip(2)
	if err := f.v.ReadFull(make([]byte, f.v.Size())); !errors.Is(err, ErrShort) || f.v.Pos() != 2 {
		t.Fatalf("over-long read: %v, pos %d", err, f.v.Pos())
	}
}

func TestWriteFullAcrossSegments(t *testing.T) {
	f := newFixture(t, 8, 4, 1, 6, 2)
	p := []byte("abcdefghijklm") // 13 = 4+1+6+2
	if err := f.v.WriteFull(p[:3]); err != nil {
		t.Fatal(err)
	}
	if err := f.v.WriteFull(p[3:12]); err != nil {
		t.Fatal(err)
	}
	if err := f.v.WriteFull(p[12:]); err != nil {
		t.Fatal(err)
	}
	if got, _ := f.flat(); !bytes.Equal(got, p) {
		t.Fatalf("wrote %q, want %q", got, p)
	}
	if err := f.v.WriteFull([]byte{1}); !errors.Is(err, ErrShort) {
		t.Fatalf("write at end: %v", err)
	}
	f.checkGuards(t)
	// Segments as seen through Segments().
	var joined []byte
	for _, s := range f.v.Segments() {
		joined = append(joined, s.Buf...)
	}
	if !bytes.Equal(joined, p) {
		t.Fatalf("segments hold %q", joined)
	}
}

func TestSkipSeek(t *testing.T) {
	f := newFixture(t, 8, 3, 4, 5)
	want, _ := f.flat()
	v := f.v
	tests := []struct {
		op      string
		arg     int
		wantErr bool
		pos     int
	}{
		{"skip", 0, false, 0},
		{"skip", 3, false, 3}, // exactly to a segment boundary
		{"skip", 5, false, 8},
		{"skip", 4, false, 12}, // exactly to the end
		{"skip", 1, true, 12},
		{"seek", 0, false, 0},
		{"skip", -1, true, 0},
		{"seek", 7, false, 7},
		{"seek", 12, false, 12},
		{"seek", 13, true, 12},
		{"seek", -1, true, 12},
		{"seek", 2, false, 2},
		{"skip", 11, true, 2},
		{"skip", 10, false, 12},
	}
	for i, tc := range tests {
		var err error
		if tc.op == "skip" {
			err = v.Skip(tc.arg)
		} else {
			err = v.Seek(tc.arg)
		}
		if (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, ErrShort)) {
			t.Errorf("%d: %s(%d): err %v, want error %v", i, tc.op, tc.arg, err, tc.wantErr)
		}
		if v.Pos() != tc.pos || v.Len() != v.Size()-tc.pos {
			t.Errorf("%d: %s(%d): pos %d len %d, want pos %d", i, tc.op, tc.arg, v.Pos(), v.Len(), tc.pos)
		}
		// The cursor reads the right byte after every move.
		if v.Len() > 0 {
			var b [1]byte
			if err := v.ReadFull(b[:]); err != nil || b[0] != want[v.Pos()-1] {
				t.Errorf("%d: byte at %d is %#x (%v), want %#x", i, tc.pos, b[0], err, want[tc.pos])
			}
			v.Seek(tc.pos)
		}
	}
}

func TestWriteAt(t *testing.T) {
	f := newFixture(t, 8, 2, 3, 4)
	v := f.v
	v.Skip(5)
	tests := []struct {
		p       string
		pos     int
		wantErr error
	}{
		{"AB", 0, nil},
		{"XYZ", 1, nil},  // straddles 2|3
		{"1234", 5, nil}, // the last segment exactly
		{"Q", 8, nil},    // the last byte
		{"QQ", 8, ErrShort},
		{"", 9, nil},
		{"", 10, ErrShort},
		{"a", -1, ErrShort},
	}
	for _, tc := range tests {
		before, _ := f.flat()
		err := v.WriteAt([]byte(tc.p), tc.pos)
		if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
			t.Errorf("WriteAt(%q, %d): %v, want %v", tc.p, tc.pos, err, tc.wantErr)
		}
		after, _ := f.flat()
		if err == nil {
			copy(before[tc.pos:], tc.p)
		}
		if !bytes.Equal(before, after) {
			t.Errorf("WriteAt(%q, %d): bytes %q, want %q", tc.p, tc.pos, after, before)
		}
		if v.Pos() != 5 {
			t.Errorf("WriteAt(%q, %d) moved the cursor to %d", tc.p, tc.pos, v.Pos())
		}
	}
	// The cursor still reads from where it was.
	var b [4]byte
	if err := v.ReadFull(b[:]); err != nil || string(b[:]) != "123Q" {
		t.Errorf("read after WriteAt: %q %v", b, err)
	}
	f.checkGuards(t)
}

func TestZero(t *testing.T) {
	f := newFixture(t, 8, 3, 2, 4)
	v := f.v
	v.Skip(1)
	if err := v.Zero(5); err != nil {
		t.Fatal(err)
	}
	got, _ := f.flat()
	for i := 1; i < 6; i++ {
		if got[i] != 0 {
			t.Fatalf("byte %d not zeroed: %x", i, got)
		}
	}
	if got[0] == 0 || got[6] == 0 {
		t.Fatalf("zeroed too much: %x", got)
	}
	if v.Pos() != 6 {
		t.Fatalf("pos %d after Zero", v.Pos())
	}
	if err := v.Zero(4); !errors.Is(err, ErrShort) || v.Pos() != 6 {
		t.Fatalf("Zero past end: %v pos %d", err, v.Pos())
	}
	if err := v.Zero(-1); !errors.Is(err, ErrShort) || v.Pos() != 6 {
		t.Fatalf("Zero(-1): %v pos %d", err, v.Pos())
	}
	if err := v.Zero(0); err != nil {
		t.Fatal(err)
	}
	if err := v.Zero(3); err != nil || v.Len() != 0 {
		t.Fatalf("Zero to the end: %v, len %d", err, v.Len())
	}
	f.checkGuards(t)
}

func TestContiguous(t *testing.T) {
	f := newFixture(t, 8, 4, -3, 5)
	v := f.v
	tests := []struct {
		pos, n int
		ok     bool
	}{
		{0, 0, true},
		{0, 4, true},
		{0, 5, false}, // straddles into the unmapped segment
		{2, 2, true},
		{3, 1, true},
		{4, 1, false}, // unmapped
		{4, 0, true},  // nothing requested
		{7, 5, true},
		{7, 6, false}, // beyond the end
		{8, 4, true},
		{12, 0, true},
		{12, 1, false},
		{0, -1, false},
		{8, -3, false},
		{12, -1, false},
	}
	for _, tc := range tests {
		v.Seek(tc.pos)
		b, ok := v.Contiguous(tc.n)
		if ok != tc.ok {
			t.Errorf("Contiguous(%d) at %d: ok %v, want %v", tc.n, tc.pos, ok, tc.ok)
			continue
		}
		if v.Pos() != tc.pos {
			t.Errorf("Contiguous moved the cursor")
		}
		if !ok {
			if b != nil {
				t.Errorf("Contiguous(%d) at %d: bytes with ok=false", tc.n, tc.pos)
			}
			continue
		}
		if len(b) != tc.n {
			t.Errorf("Contiguous(%d) at %d: %d bytes", tc.n, tc.pos, len(b))
			continue
		}
		if tc.n > 0 {
			want := make([]byte, tc.n)
			v.ReadFull(want)
			if !bytes.Equal(b, want) {
				t.Errorf("Contiguous(%d) at %d: %x, want %x", tc.n, tc.pos, b, want)
			}
			// In place: it aliases guest memory.
			b[0] ^= 0xff
			v.Seek(tc.pos)
			var c [1]byte
			v.ReadFull(c[:])
			if c[0] != b[0] {
				t.Errorf("Contiguous(%d) at %d does not alias the segment", tc.n, tc.pos)
			}
			b[0] ^= 0xff
		}
	}
}

func TestUnmapped(t *testing.T) {
	f := newFixture(t, 8, 4, -3, 5)
	v := f.v
	before, _ := f.flat()
	tests := []struct {
		pos, n int
		err    error
		unm    bool // Unmapped(n): clamped to what is left
	}{
		{0, 4, nil, false},
		{0, 5, ErrUnmapped, true},
		{3, 2, ErrUnmapped, true},
		{4, 1, ErrUnmapped, true},
		{5, 2, ErrUnmapped, true},
		{7, 5, nil, false},
		{7, 6, ErrShort, false},
		{0, 13, ErrShort, true},
	}
	for _, tc := range tests {
		check := func(op string, err error) {
			t.Helper()
			if !errors.Is(err, tc.err) || (tc.err == nil && err != nil) {
				t.Errorf("%s(%d) at %d: %v, want %v", op, tc.n, tc.pos, err, tc.err)
			}
			if err == nil {
				if v.Pos() != tc.pos+tc.n {
					t.Errorf("%s(%d) at %d: pos %d", op, tc.n, tc.pos, v.Pos())
				}
			} else if v.Pos() != tc.pos {
				t.Errorf("%s(%d) at %d failed but moved the cursor to %d", op, tc.n, tc.pos, v.Pos())
			}
			v.Seek(tc.pos)
		}
		v.Seek(tc.pos)
		if got := v.Unmapped(tc.n); got != tc.unm {
			t.Errorf("Unmapped(%d) at %d = %v", tc.n, tc.pos, got)
		}
		p := make([]byte, tc.n)
		check("ReadFull", v.ReadFull(p))
		if tc.err != nil {
			for _, b := range p {
				if b != 0 {
					t.Errorf("failed ReadFull(%d) at %d filled the buffer: %x", tc.n, tc.pos, p)
					break
				}
			}
		}
		if tc.err == nil {
			continue // keep the data for the failure cases
		}
		check("WriteFull", v.WriteFull(bytes.Repeat([]byte{0xEE}, tc.n)))
		check("Zero", v.Zero(tc.n))
		if err := v.WriteAt(bytes.Repeat([]byte{0xEE}, tc.n), tc.pos); !errors.Is(err, tc.err) || v.Pos() != tc.pos {
			t.Errorf("WriteAt(%d, %d): %v, pos %d", tc.n, tc.pos, err, v.Pos())
		}
		if after, _ := f.flat(); !bytes.Equal(before, after) {
			t.Fatalf("failed copy (%d at %d) changed bytes: %x, was %x", tc.n, tc.pos, after, before)
		}
	}
	f.checkGuards(t)
}

func TestAppendAfterConsumed(t *testing.T) {
	// A cursor at the end stays valid when more segments are appended.
	f := newFixture(t, 4, 3)
	v := f.v
	if err := v.Skip(3); err != nil {
		t.Fatal(err)
	}
	extra := []byte("xyz")
	if err := v.Append(Segment{Buf: extra, GPA: 0x9000, Len: 3}); err != nil {
		t.Fatal(err)
	}
	var b [3]byte
	if err := v.ReadFull(b[:]); err != nil || string(b[:]) != "xyz" {
		t.Fatalf("read after append: %q %v", b, err)
	}
}

// Truncate keeps the first n bytes, across and within segments, mapped or
// not; it refuses to cut behind the cursor or beyond the end.
func TestTruncate(t *testing.T) {
	for _, n := range []int{0, 1, 3, 4, 7, 8, 11, 12} {
		f := newFixture(t, 8, 3, -4, 5)
		want, _ := f.flat()
		v := f.v
		if err := v.Truncate(n); err != nil {
			t.Fatalf("Truncate(%d): %v", n, err)
		}
		if v.Size() != n || v.Len() != n {
			t.Fatalf("Truncate(%d): size %d len %d", n, v.Size(), v.Len())
		}
		sum := 0
		for _, s := range v.Segments() {
			if s.Len == 0 || (s.Buf != nil && len(s.Buf) != int(s.Len)) {
				t.Fatalf("Truncate(%d): segment %+v", n, s)
			}
			sum += int(s.Len)
		}
		if sum != n {
			t.Fatalf("Truncate(%d): segments hold %d", n, sum)
		}
		// The mapped bytes kept are the first n.
		if n <= 3 {
			got := make([]byte, n)
			if err := v.ReadFull(got); err != nil || !bytes.Equal(got, want[:n]) {
				t.Fatalf("Truncate(%d): read %x %v, want %x", n, got, err, want[:n])
			}
		}
		if v.Skip(v.Len()) != nil || v.Skip(1) == nil {
			t.Fatalf("Truncate(%d): cursor walks past the end", n)
		}
	}
	f := newFixture(t, 8, 3, 4, 5)
	f.v.Skip(5)
	for _, n := range []int{-1, 4, 13} {
		if err := f.v.Truncate(n); !errors.Is(err, ErrShort) {
			t.Fatalf("Truncate(%d) at 5: %v", n, err)
		}
	}
	if err := f.v.Truncate(5); err != nil || f.v.Len() != 0 {
		t.Fatalf("Truncate at the cursor: %v, len %d", err, f.v.Len())
	}
}
