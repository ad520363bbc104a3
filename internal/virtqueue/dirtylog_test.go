package virtqueue

import (
	"sync"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// bits returns the page numbers set in a bitmap, read as QEMU does (bit
// page%8 of byte page/8).
func bits(b []byte) []uint64 {
	var ps []uint64
	for i, v := range b {
		for j := range 8 {
			if v&(1<<j) != 0 {
				ps = append(ps, uint64(i*8+j))
			}
		}
	}
	return ps
}

func eqPages(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestDirtyLogMark(t *testing.T) {
	const size = 16 // bytes: pages 0..127
	for _, tc := range []struct {
		name   string
		gpa, n uint64
		want   []uint64
		beyond uint64
	}{
		{"one byte", 0x1000, 1, []uint64{1}, 0},
		{"last byte of a page", 0x1fff, 1, []uint64{1}, 0},
		{"straddles two pages", 0x1ffe, 4, []uint64{1, 2}, 0},
		{"whole word", 0, 32 << 12, seq(0, 32), 0},
		{"across words", 30 << 12, 4 << 12, seq(30, 34), 0},
		{"to the last page", 120 << 12, 8 << 12, seq(120, 128), 0},
		{"partly beyond", 126 << 12, 4 << 12, []uint64{126, 127}, 2},
		{"wholly beyond", 200 << 12, 1, nil, 1},
		{"empty", 0x5000, 0, nil, 0},
		{"wraps", ^uint64(0) - 10, 100, nil, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var l DirtyLog
			m := make([]byte, size)
			l.Replace(m, nil)
			l.SetActive(true)
			l.Mark(tc.gpa, tc.n)
			if got := bits(m); !eqPages(got, tc.want) {
				t.Errorf("pages %v, want %v", got, tc.want)
			}
			if tc.name != "wraps" && l.Beyond() != tc.beyond {
				t.Errorf("beyond %d, want %d", l.Beyond(), tc.beyond)
			}
		})
	}
}

func seq(from, to uint64) []uint64 {
	var s []uint64
	for i := from; i < to; i++ {
		s = append(s, i)
	}
	return s
}

// TestDirtyLogMarkWritten: only the first n bytes of the writable segments
// are logged, unmapped segments never.
func TestDirtyLogMarkWritten(t *testing.T) {
	var l DirtyLog
	m := make([]byte, 8)
	l.Replace(m, nil)
	l.SetActive(true)
	v := bufvec.NewVec(8)
	buf := make([]byte, 3*4096)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(v.Append(bufvec.Segment{Buf: buf[:16], GPA: 0x3000, Len: 16}))      // out header: page 3
	must(v.Append(bufvec.Segment{Buf: buf[:4096], GPA: 0x8000, Len: 4096}))  // page 8
	must(v.Append(bufvec.Segment{GPA: 0x9000, Len: 4096}))                   // unmapped (DAX): page 9, not ours
	must(v.Append(bufvec.Segment{Buf: buf[:4096], GPA: 0xa000, Len: 4096}))  // page 10
	must(v.Append(bufvec.Segment{Buf: buf[:4096], GPA: 0x20000, Len: 4096})) // page 32: beyond the used length
	l.MarkWritten(v, 16+4096+4096+100)
	if got, want := bits(m), []uint64{3, 8, 10}; !eqPages(got, want) {
		t.Errorf("pages %v, want %v", got, want)
	}
}

// TestDirtyLogUnmappedAndOff: marks without a bitmap are counted; Replace
// waits for a writer still marking the old bitmap.
func TestDirtyLogReplaceWaits(t *testing.T) {
	var l DirtyLog
	l.SetActive(true)
	l.Mark(0, 1)
	if l.Unlogged() != 1 {
		t.Errorf("unlogged %d, want 1", l.Unlogged())
	}
	old := make([]byte, 8)
	released := make(chan struct{})
	l.Replace(old, func([]byte) { close(released) })
	l.mu.RLock() // a writer in the middle of marking
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		l.Replace(make([]byte, 8), nil)
	}()
	select {
	case <-released:
		t.Fatal("old bitmap released while a writer used it")
	case <-time.After(50 * time.Millisecond):
	}
	l.mu.RUnlock()
	wg.Wait()
	<-released
}

// BenchmarkLogWritten is the dirty-log cost of a 1 MiB READ's reply
// (header and 256 scattered pages), logging on and off.
func BenchmarkLogWritten(b *testing.B) {
	const pages = 256
	c := NewDescChain(1024)
	page := make([]byte, 4096)
	c.Writable.Append(bufvec.Segment{Buf: page[:16], GPA: 0x80, Len: 16})
	for i := range pages {
		slot := (i*167 + 11) % 512
		c.Writable.Append(bufvec.Segment{Buf: page, GPA: 0x100000 + uint64(slot)*4096, Len: 4096})
	}
	q := &Queue{log: &DirtyLog{}}
	q.log.Replace(make([]byte, 1<<12), nil) // 128 MiB of guest memory
	n := uint32(16 + pages*4096)
	for _, on := range []bool{false, true} {
		name := "off"
		if on {
			name = "on"
		}
		b.Run(name, func(b *testing.B) {
			q.log.SetActive(on)
			b.SetBytes(int64(n))
			b.ReportAllocs()
			for b.Loop() {
				q.LogWritten(c, n)
			}
		})
	}
}
