package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"
)

// Request ids (front end → back end).
const (
	reqGetFeatures         = 1
	reqSetFeatures         = 2
	reqSetOwner            = 3
	reqResetOwner          = 4
	reqSetMemTable         = 5
	reqSetLogBase          = 6
	reqSetLogFD            = 7
	reqSetVringNum         = 8
	reqSetVringAddr        = 9
	reqSetVringBase        = 10
	reqGetVringBase        = 11
	reqSetVringKick        = 12
	reqSetVringCall        = 13
	reqSetVringErr         = 14
	reqGetProtocolFeatures = 15
	reqSetProtocolFeatures = 16
	reqGetQueueNum         = 17
	reqSetVringEnable      = 18
	reqSendRARP            = 19
	reqNetSetMTU           = 20
	reqSetBackendReqFD     = 21
	reqIOTLBMsg            = 22
	reqSetVringEndian      = 23
	reqGetConfig           = 24
	reqSetConfig           = 25
	reqGetInflightFD       = 31
	reqSetInflightFD       = 32
	reqResetDevice         = 34
	reqGetMaxMemSlots      = 36
	reqAddMemReg           = 37
	reqRemMemReg           = 38
	reqSetStatus           = 39
	reqGetStatus           = 40
	reqSetDeviceStateFD    = 42
	reqCheckDeviceState    = 43
	reqGetShmemConfig      = 44
)

var requestNames = map[uint32]string{
	reqGetFeatures:         "GET_FEATURES",
	reqSetFeatures:         "SET_FEATURES",
	reqSetOwner:            "SET_OWNER",
	reqResetOwner:          "RESET_OWNER",
	reqSetMemTable:         "SET_MEM_TABLE",
	reqSetLogBase:          "SET_LOG_BASE",
	reqSetLogFD:            "SET_LOG_FD",
	reqSetVringNum:         "SET_VRING_NUM",
	reqSetVringAddr:        "SET_VRING_ADDR",
	reqSetVringBase:        "SET_VRING_BASE",
	reqGetVringBase:        "GET_VRING_BASE",
	reqSetVringKick:        "SET_VRING_KICK",
	reqSetVringCall:        "SET_VRING_CALL",
	reqSetVringErr:         "SET_VRING_ERR",
	reqGetProtocolFeatures: "GET_PROTOCOL_FEATURES",
	reqSetProtocolFeatures: "SET_PROTOCOL_FEATURES",
	reqGetQueueNum:         "GET_QUEUE_NUM",
	reqSetVringEnable:      "SET_VRING_ENABLE",
	reqSendRARP:            "SEND_RARP",
	reqNetSetMTU:           "NET_SET_MTU",
	reqSetBackendReqFD:     "SET_BACKEND_REQ_FD",
	reqIOTLBMsg:            "IOTLB_MSG",
	reqSetVringEndian:      "SET_VRING_ENDIAN",
	reqGetConfig:           "GET_CONFIG",
	reqSetConfig:           "SET_CONFIG",
	reqGetInflightFD:       "GET_INFLIGHT_FD",
	reqSetInflightFD:       "SET_INFLIGHT_FD",
	reqResetDevice:         "RESET_DEVICE",
	reqGetMaxMemSlots:      "GET_MAX_MEM_SLOTS",
	reqAddMemReg:           "ADD_MEM_REG",
	reqRemMemReg:           "REM_MEM_REG",
	reqSetStatus:           "SET_STATUS",
	reqGetStatus:           "GET_STATUS",
	reqSetDeviceStateFD:    "SET_DEVICE_STATE_FD",
	reqCheckDeviceState:    "CHECK_DEVICE_STATE",
	reqGetShmemConfig:      "GET_SHMEM_CONFIG",
}

func requestName(r uint32) string {
	if n, ok := requestNames[r]; ok {
		return n
	}
	return fmt.Sprintf("request(%d)", r)
}

// Header flags.
const (
	flagVersion   = 0x1
	flagVersionMk = 0x3
	flagReply     = 0x4
	flagNeedReply = 0x8
)

const (
	headerSize = 12
	// maxPayload bounds what we buffer: the largest legal payload is a
	// config message (12 + 256 bytes) or a memory table (8 + 8*32 bytes).
	maxPayload = 4096
	// maxDiscard bounds how much of an oversized payload we skip to stay in
	// step with the stream before giving up on the connection.
	maxDiscard = 1 << 20
	maxFDs     = 8
)

// Message is one decoded front-end message.
type Message struct {
	Request uint32
	Flags   uint32
	Payload []byte
	FDs     []int
	// fdsLost: the front end attached more than maxFDs fds; the kernel
	// closed the rest. The stream is in step, only the fds are not.
	fdsLost bool
}

// takesFDs reports whether request req carries fds the back end uses: one
// that arrives with some of them lost cannot be honoured.
func takesFDs(req uint32) bool {
	switch req {
	case reqSetMemTable, reqSetLogBase, reqSetLogFD, reqSetVringKick, reqSetVringCall, reqSetVringErr,
		reqSetBackendReqFD, reqSetInflightFD, reqAddMemReg, reqRemMemReg, reqSetDeviceStateFD:
		return true
	}
	return false
}

func (m *Message) needReply() bool { return m.Flags&flagNeedReply != 0 }

// closeFDs closes every fd the message carried that was not taken.
func (m *Message) closeFDs() {
	for i, fd := range m.FDs {
		if fd >= 0 {
			unix.Close(fd)
			m.FDs[i] = -1
		}
	}
}

// takeFD removes and returns the message's only fd, or -1. Extra fds are
// closed.
func (m *Message) takeFD() int {
	if len(m.FDs) == 0 {
		return -1
	}
	fd := m.FDs[0]
	m.FDs[0] = -1
	m.closeFDs()
	return fd
}

// isDisconnect reports whether err means the front end has gone away: end
// of stream (also in the middle of a message), a reset connection (a peer
// that closed with our reply unread), or a write to a closed peer.
func isDisconnect(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, unix.ECONNRESET) || errors.Is(err, unix.EPIPE)
}

// errProtocol marks stream errors after which the connection cannot be
// trusted to be in step.
var errProtocol = errors.New("vhost-user protocol error")

// conn reads and writes vhost-user messages on a unix stream socket.
type conn struct {
	c   *net.UnixConn
	oob []byte
	buf [headerSize + maxPayload]byte
	// fdsCut is set when a message came with more fds than maxFDs: the
	// kernel closed those beyond, so the message cannot be honoured.
	fdsCut bool
}

func newConn(c *net.UnixConn) *conn {
	return &conn{c: c, oob: make([]byte, unix.CmsgSpace(maxFDs*4))}
}

// read reads n bytes into p, collecting any fds that arrive with them.
func (c *conn) read(p []byte, fds *[]int) error {
	for len(p) > 0 {
		n, oobn, flags, _, err := c.c.ReadMsgUnix(p, c.oob)
		n, oobn = max(n, 0), max(oobn, 0) // -1 on some errors
		if oobn > 0 {
			if perr := parseRights(c.oob[:oobn], fds); perr != nil && err == nil {
				err = perr
			}
		}
		if flags&unix.MSG_CTRUNC != 0 {
			c.fdsCut = true
		}
		p = p[n:]
		if err != nil {
			return err
		}
		if n == 0 {
			return io.EOF
		}
	}
	return nil
}

func parseRights(oob []byte, fds *[]int) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return err
	}
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			continue
		}
		*fds = append(*fds, got...)
	}
	return nil
}

// readMessage reads one message. On error every received fd is closed. A
// message whose payload is larger than any legal one is skipped (when it is
// not absurdly large) and reported with its request id, so the caller can
// refuse it and go on.
func (c *conn) readMessage() (*Message, error) {
	m := &Message{}
	c.fdsCut = false
	hdr := c.buf[:headerSize]
	if err := c.read(hdr, &m.FDs); err != nil {
		m.closeFDs()
		if errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, err
	}
	m.Request = binary.LittleEndian.Uint32(hdr[0:])
	m.Flags = binary.LittleEndian.Uint32(hdr[4:])
	size := binary.LittleEndian.Uint32(hdr[8:])
	if m.Flags&flagVersionMk != flagVersion {
		m.closeFDs()
		return nil, fmt.Errorf("%w: %s with flags %#x: unsupported version", errProtocol, requestName(m.Request), m.Flags)
	}
	if size > maxPayload {
		if size > maxDiscard {
			m.closeFDs()
			return nil, fmt.Errorf("%w: %s payload of %d bytes", errProtocol, requestName(m.Request), size)
		}
		for left := int(size); left > 0; {
			n := min(left, maxPayload)
			if err := c.read(c.buf[headerSize:headerSize+n], &m.FDs); err != nil {
				m.closeFDs()
				return nil, err
			}
			left -= n
		}
		m.closeFDs()
		return m, fmt.Errorf("payload of %d bytes exceeds %d", size, maxPayload)
	}
	m.Payload = make([]byte, size)
	if err := c.read(m.Payload, &m.FDs); err != nil {
		m.closeFDs()
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%s: connection closed inside the payload: %w", requestName(m.Request), io.ErrUnexpectedEOF)
		}
		return nil, err
	}
	m.fdsLost = c.fdsCut
	return m, nil
}

// reply sends a reply to request req.
func (c *conn) reply(req uint32, payload []byte) error {
	b := make([]byte, headerSize+len(payload))
	binary.LittleEndian.PutUint32(b[0:], req)
	binary.LittleEndian.PutUint32(b[4:], flagVersion|flagReply)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(payload)))
	copy(b[headerSize:], payload)
	_, err := c.c.Write(b)
	return err
}

func (c *conn) replyU64(req uint32, v uint64) error {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], v)
	return c.reply(req, b[:])
}

// Payload decoders. Each checks the payload size first.

func payloadU64(m *Message) (uint64, error) {
	if len(m.Payload) < 8 {
		return 0, fmt.Errorf("payload of %d bytes, want 8", len(m.Payload))
	}
	return binary.LittleEndian.Uint64(m.Payload), nil
}

type vringState struct{ index, num uint32 }

func payloadVringState(m *Message) (vringState, error) {
	if len(m.Payload) < 8 {
		return vringState{}, fmt.Errorf("payload of %d bytes, want 8", len(m.Payload))
	}
	return vringState{binary.LittleEndian.Uint32(m.Payload), binary.LittleEndian.Uint32(m.Payload[4:])}, nil
}

type vringAddr struct {
	index                     uint32
	flags                     uint32
	desc, used, avail, logGPA uint64
}

func payloadVringAddr(m *Message) (vringAddr, error) {
	p := m.Payload
	if len(p) < 40 {
		return vringAddr{}, fmt.Errorf("payload of %d bytes, want 40", len(p))
	}
	return vringAddr{
		index:  binary.LittleEndian.Uint32(p[0:]),
		flags:  binary.LittleEndian.Uint32(p[4:]),
		desc:   binary.LittleEndian.Uint64(p[8:]),
		used:   binary.LittleEndian.Uint64(p[16:]),
		avail:  binary.LittleEndian.Uint64(p[24:]),
		logGPA: binary.LittleEndian.Uint64(p[32:]),
	}, nil
}

// memRegionDesc is a memory region as the front end sends it.
type memRegionDesc struct {
	gpa, size, uva, mmapOffset uint64
}

const memRegionSize = 32

func decodeRegion(p []byte) memRegionDesc {
	return memRegionDesc{
		gpa:        binary.LittleEndian.Uint64(p[0:]),
		size:       binary.LittleEndian.Uint64(p[8:]),
		uva:        binary.LittleEndian.Uint64(p[16:]),
		mmapOffset: binary.LittleEndian.Uint64(p[24:]),
	}
}

// maxTableRegions is VHOST_MEMORY_BASELINE_NREGIONS: the most regions one
// SET_MEM_TABLE carries (one fd each, and a message carries at most 8 fds).
const maxTableRegions = 8

func payloadMemTable(m *Message) ([]memRegionDesc, error) {
	p := m.Payload
	if len(p) < 8 {
		return nil, fmt.Errorf("payload of %d bytes, want at least 8", len(p))
	}
	n := binary.LittleEndian.Uint32(p)
	if n == 0 || n > maxTableRegions {
		return nil, fmt.Errorf("%d regions, want 1..%d", n, maxTableRegions)
	}
	if uint64(len(p)) < 8+uint64(n)*memRegionSize {
		return nil, fmt.Errorf("payload of %d bytes too short for %d regions", len(p), n)
	}
	if len(m.FDs) != int(n) {
		return nil, fmt.Errorf("%d regions but %d fds", n, len(m.FDs))
	}
	rs := make([]memRegionDesc, n)
	for i := range rs {
		rs[i] = decodeRegion(p[8+i*memRegionSize:])
	}
	return rs, nil
}

func payloadSingleRegion(m *Message) (memRegionDesc, error) {
	if len(m.Payload) < 8+memRegionSize {
		return memRegionDesc{}, fmt.Errorf("payload of %d bytes, want %d", len(m.Payload), 8+memRegionSize)
	}
	return decodeRegion(m.Payload[8:]), nil
}
