package vmm

import (
	"encoding/binary"
	"fmt"
)

// Request is a vhost-user front-end request id.
type Request uint32

// Front-end requests (vhost-user.rst). Only those a vhost-user-fs front end
// may send are listed.
const (
	GetFeatures         Request = 1
	SetFeatures         Request = 2
	SetOwner            Request = 3
	ResetOwner          Request = 4
	SetMemTable         Request = 5
	SetLogBase          Request = 6
	SetLogFd            Request = 7
	SetVringNum         Request = 8
	SetVringAddr        Request = 9
	SetVringBase        Request = 10
	GetVringBase        Request = 11
	SetVringKick        Request = 12
	SetVringCall        Request = 13
	SetVringErr         Request = 14
	GetProtocolFeatures Request = 15
	SetProtocolFeatures Request = 16
	GetQueueNum         Request = 17
	SetVringEnable      Request = 18
	SetBackendReqFd     Request = 21
	GetConfig           Request = 24
	SetConfig           Request = 25
	GetInflightFd       Request = 31
	SetInflightFd       Request = 32
	ResetDevice         Request = 34
	GetMaxMemSlots      Request = 36
	AddMemReg           Request = 37
	RemMemReg           Request = 38
	SetStatus           Request = 39
	GetStatus           Request = 40
	SetDeviceStateFd    Request = 42
	CheckDeviceState    Request = 43
	GetShmemConfig      Request = 44
)

var requestNames = map[Request]string{
	GetFeatures: "GET_FEATURES", SetFeatures: "SET_FEATURES", SetOwner: "SET_OWNER",
	ResetOwner: "RESET_OWNER", SetMemTable: "SET_MEM_TABLE", SetLogBase: "SET_LOG_BASE",
	SetLogFd: "SET_LOG_FD", SetVringNum: "SET_VRING_NUM", SetVringAddr: "SET_VRING_ADDR",
	SetVringBase: "SET_VRING_BASE", GetVringBase: "GET_VRING_BASE", SetVringKick: "SET_VRING_KICK",
	SetVringCall: "SET_VRING_CALL", SetVringErr: "SET_VRING_ERR",
	GetProtocolFeatures: "GET_PROTOCOL_FEATURES", SetProtocolFeatures: "SET_PROTOCOL_FEATURES",
	GetQueueNum: "GET_QUEUE_NUM", SetVringEnable: "SET_VRING_ENABLE",
	SetBackendReqFd: "SET_BACKEND_REQ_FD", GetConfig: "GET_CONFIG", SetConfig: "SET_CONFIG",
	GetInflightFd: "GET_INFLIGHT_FD", SetInflightFd: "SET_INFLIGHT_FD", ResetDevice: "RESET_DEVICE",
	GetMaxMemSlots: "GET_MAX_MEM_SLOTS", AddMemReg: "ADD_MEM_REG", RemMemReg: "REM_MEM_REG",
	SetStatus: "SET_STATUS", GetStatus: "GET_STATUS", SetDeviceStateFd: "SET_DEVICE_STATE_FD",
	CheckDeviceState: "CHECK_DEVICE_STATE", GetShmemConfig: "GET_SHMEM_CONFIG",
}

func (r Request) String() string {
	if n, ok := requestNames[r]; ok {
		return n
	}
	return fmt.Sprintf("REQUEST_%d", uint32(r))
}

// HasReply reports whether the request always has a reply of its own
// (independent of REPLY_ACK).
func (r Request) HasReply() bool {
	switch r {
	case GetFeatures, GetProtocolFeatures, GetQueueNum, GetVringBase, GetConfig,
		GetInflightFd, GetMaxMemSlots, GetStatus, SetLogBase, SetDeviceStateFd, CheckDeviceState,
		GetShmemConfig:
		return true
	}
	return false
}

// Backend requests (sent by the back end on the SET_BACKEND_REQ_FD channel).
const (
	BackendIOTLBMsg          Request = 1
	BackendConfigChangeMsg   Request = 2
	BackendVringHostNotifier Request = 3
	// BackendShmemMap and BackendShmemUnmap map a file into a
	// shared-memory region and remove such a mapping (QEMU 11.1,
	// DESIGN §13): body ShmemMsg, one fd with MAP.
	BackendShmemMap   Request = 9
	BackendShmemUnmap Request = 10
	// BackendFSIO is the bounce-through-the-VMM request of DESIGN §3.
	BackendFSIO Request = 1003
)

// Header flags.
const (
	FlagVersion   = 0x1    // protocol version 1, in every message
	FlagReply     = 1 << 2 // the message is a reply
	FlagNeedReply = 1 << 3 // the sender wants a REPLY_ACK u64
	// ReplyFlags is what every reply must carry, exactly.
	ReplyFlags = FlagVersion | FlagReply
)

// HeaderSize is the size of the vhost-user message header.
const HeaderSize = 12

// MaxFds is how many fds one message may carry.
const MaxFds = 8

// Virtio feature bits relevant to vhost-user-fs.
const (
	FIndirectDesc     = 28 // VIRTIO_RING_F_INDIRECT_DESC
	FEventIdx         = 29 // VIRTIO_RING_F_EVENT_IDX
	FProtocolFeatures = 30 // VHOST_USER_F_PROTOCOL_FEATURES
	FVersion1         = 32 // VIRTIO_F_VERSION_1
	FNotifyOnEmpty    = 24 // VIRTIO_F_NOTIFY_ON_EMPTY
	FLogAll           = 26 // VHOST_F_LOG_ALL
	FRingPacked       = 34 // VIRTIO_F_RING_PACKED
	FRingReset        = 40 // VIRTIO_F_RING_RESET
)

// Protocol feature bits.
const (
	PMQ                = 0
	PLogShmfd          = 1
	PRARP              = 2
	PReplyAck          = 3
	PMTU               = 4
	PBackendReq        = 5
	PCrossEndian       = 6
	PCryptoSession     = 7
	PPagefault         = 8
	PConfig            = 9
	PBackendSendFd     = 10
	PHostNotifier      = 11
	PInflightShmfd     = 12
	PResetDevice       = 13
	PInbandNotif       = 14
	PConfigureMemSlots = 15
	PStatus            = 16
	PDeviceState       = 19
	PShmem             = 22 // shared-memory regions: GET_SHMEM_CONFIG, SHMEM_MAP/UNMAP
)

// Bit returns 1<<b, for building feature masks.
func Bit(b uint) uint64 { return 1 << b }

// Vring file message (KICK/CALL/ERR) payload bits.
const (
	VringIdxMask  = 0xff
	VringNoFdMask = 1 << 8
)

// Virtio device status bits (SET_STATUS).
const (
	StatusAcknowledge = 1
	StatusDriver      = 2
	StatusDriverOK    = 4
	StatusFeaturesOK  = 8
	StatusNeedsReset  = 64
	StatusFailed      = 128
)

var le = binary.LittleEndian

// U64 encodes the u64 payload of features, status, slots and queue numbers.
func U64(v uint64) []byte { return le.AppendUint64(nil, v) }

// VringState is the {u32 index, u32 num} payload.
type VringState struct{ Index, Num uint32 }

// Bytes encodes the payload.
func (s VringState) Bytes() []byte {
	b := le.AppendUint32(nil, s.Index)
	return le.AppendUint32(b, s.Num)
}

// VringAddr is the SET_VRING_ADDR payload. Desc, Used and Avail are
// front-end virtual addresses; Log is the guest-physical address of the
// used ring (for dirty logging).
type VringAddr struct {
	Index, Flags      uint32
	Desc, Used, Avail uint64
	Log               uint64
}

// Bytes encodes the payload.
func (a VringAddr) Bytes() []byte {
	b := le.AppendUint32(nil, a.Index)
	b = le.AppendUint32(b, a.Flags)
	b = le.AppendUint64(b, a.Desc)
	b = le.AppendUint64(b, a.Used)
	b = le.AppendUint64(b, a.Avail)
	return le.AppendUint64(b, a.Log)
}

// MemRegion is one region of SET_MEM_TABLE, ADD_MEM_REG and REM_MEM_REG.
type MemRegion struct {
	GuestPhysAddr, MemorySize, UserAddr, MmapOffset uint64
}

func (r MemRegion) append(b []byte) []byte {
	b = le.AppendUint64(b, r.GuestPhysAddr)
	b = le.AppendUint64(b, r.MemorySize)
	b = le.AppendUint64(b, r.UserAddr)
	return le.AppendUint64(b, r.MmapOffset)
}

// MemTableBytes encodes a SET_MEM_TABLE payload: {u32 nregions, u32
// padding, regions...}.
func MemTableBytes(regions []MemRegion) []byte {
	b := le.AppendUint32(nil, uint32(len(regions)))
	b = le.AppendUint32(b, 0)
	for _, r := range regions {
		b = r.append(b)
	}
	return b
}

// SingleRegionBytes encodes an ADD_MEM_REG/REM_MEM_REG payload: {u64
// padding, region}.
func SingleRegionBytes(r MemRegion) []byte {
	return r.append(make([]byte, 8))
}

// VringFile encodes a KICK/CALL/ERR payload: the queue index in bits 0-7,
// and VringNoFdMask when no fd is attached.
func VringFile(index uint32, noFd bool) []byte {
	v := uint64(index & VringIdxMask)
	if noFd {
		v |= VringNoFdMask
	}
	return U64(v)
}

// ConfigMsg is the GET_CONFIG/SET_CONFIG payload.
type ConfigMsg struct {
	Offset, Size, Flags uint32
	Payload             []byte
}

// Bytes encodes the payload; Size is written as given.
func (c ConfigMsg) Bytes() []byte {
	b := le.AppendUint32(nil, c.Offset)
	b = le.AppendUint32(b, c.Size)
	b = le.AppendUint32(b, c.Flags)
	return append(b, c.Payload...)
}

// Inflight is the GET_INFLIGHT_FD/SET_INFLIGHT_FD payload.
type Inflight struct {
	MmapSize, MmapOffset uint64
	NumQueues, QueueSize uint16
}

// Bytes encodes the payload.
func (f Inflight) Bytes() []byte {
	b := le.AppendUint64(nil, f.MmapSize)
	b = le.AppendUint64(b, f.MmapOffset)
	b = le.AppendUint16(b, f.NumQueues)
	return le.AppendUint16(b, f.QueueSize)
}

// FSIO is the payload of the BackendFSIO request: up to 8 transfers between
// the attached fd and guest memory (DESIGN §3).
type FSIO struct {
	FdOffset, COffset, Len, Flags [8]uint64
}

// FS_IO transfer directions.
const (
	FSIORead  = 1 // MAP_R: file -> guest
	FSIOWrite = 2 // MAP_W: guest -> file
)

// FSIOSize is the encoded size of FSIO.
const FSIOSize = 4 * 8 * 8

// ParseFSIO decodes an FS_IO payload.
func ParseFSIO(b []byte) (FSIO, error) {
	var f FSIO
	if len(b) != FSIOSize {
		return f, fmt.Errorf("vmm: FS_IO payload is %d bytes, want %d", len(b), FSIOSize)
	}
	for i := range 8 {
		f.FdOffset[i] = le.Uint64(b[i*8:])
		f.COffset[i] = le.Uint64(b[64+i*8:])
		f.Len[i] = le.Uint64(b[128+i*8:])
		f.Flags[i] = le.Uint64(b[192+i*8:])
	}
	return f, nil
}

// Bytes encodes the payload.
func (f FSIO) Bytes() []byte {
	var b []byte
	for _, a := range [][8]uint64{f.FdOffset, f.COffset, f.Len, f.Flags} {
		for _, v := range a {
			b = le.AppendUint64(b, v)
		}
	}
	return b
}

// ShmemMsg is the body of BackendShmemMap and BackendShmemUnmap.
type ShmemMsg struct {
	ShmID                           uint8
	FdOffset, ShmOffset, Len, Flags uint64
}

// ShmemMsgSize is the encoded size of ShmemMsg; ShmemWritable is its
// flags bit for a writable mapping.
const (
	ShmemMsgSize  = 40
	ShmemWritable = 1
)

// ParseShmemMsg decodes a SHMEM_MAP/UNMAP body.
func ParseShmemMsg(b []byte) (ShmemMsg, error) {
	if len(b) != ShmemMsgSize {
		return ShmemMsg{}, fmt.Errorf("vmm: SHMEM body is %d bytes, want %d", len(b), ShmemMsgSize)
	}
	return ShmemMsg{ShmID: b[0], FdOffset: le.Uint64(b[8:]), ShmOffset: le.Uint64(b[16:]),
		Len: le.Uint64(b[24:]), Flags: le.Uint64(b[32:])}, nil
}

// Bytes encodes the body.
func (s ShmemMsg) Bytes() []byte {
	b := make([]byte, 8, ShmemMsgSize)
	b[0] = s.ShmID
	for _, v := range []uint64{s.FdOffset, s.ShmOffset, s.Len, s.Flags} {
		b = le.AppendUint64(b, v)
	}
	return b
}

// ShmemConfigSize is the size of GET_SHMEM_CONFIG's reply: u32 nregions,
// u32 padding, u64 sizes[256].
const ShmemConfigSize = 8 + 8*256
